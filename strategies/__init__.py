"""Hypothesis strategies for attention problems. Import as ``import strategies as fs``."""
from strategies.case import EPS, OVERFLOW_LOG, REGIMES, AttentionCase, quantize
from strategies.draw import LIMITS, cases, fit, limits

__all__ = ["AttentionCase", "EPS", "LIMITS", "OVERFLOW_LOG", "REGIMES", "cases", "fit", "limits", "quantize"]
