"""Hypothesis strategies for attention problems. Import as ``from flashcheck import strategies as fs``."""
from flashcheck.strategies.case import EPS, OVERFLOW_LOG, REGIMES, AttentionCase, quantize
from flashcheck.strategies.draw import LIMITS, cases, fit, limits
from flashcheck.strategies.features import FEATURES

__all__ = ["AttentionCase", "EPS", "FEATURES", "LIMITS", "OVERFLOW_LOG", "REGIMES", "cases", "fit", "limits",
           "quantize"]
