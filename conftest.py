"""The checkout's own pytest set-up. Everything that runs kernels lives in the plugin
(flashcheck/plugin.py), which an install registers through its pytest11 entry point;
a checkout used without installing it loads the plugin here.
"""
from importlib.metadata import entry_points

if not any(ep.value == "flashcheck.plugin" for ep in entry_points(group="pytest11")):
    pytest_plugins = ["flashcheck.plugin"]
