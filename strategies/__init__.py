"""Hypothesis strategies for attention problems. Import as ``import strategies as fs``."""
from strategies.case import EPS, OVERFLOW_LOG, REGIMES, AttentionCase, quantize
from strategies.draw import LIMITS, cases, fit, limits
from strategies.features import FEATURES

__all__ = ["AttentionCase", "EPS", "FEATURES", "LIMITS", "OVERFLOW_LOG", "REGIMES", "cases", "fit", "limits",
           "quantize"]
