"""Short helpers the property tests share. Import as ``from flashcheck.properties import helpers as ph``."""
from __future__ import annotations

import numpy as np

from flashcheck.impls import call

RESULTS = ("o", "lse", "dq", "dk", "dv")


def forward(impl, case, q=None, k=None, v=None) -> call.Result:
    """Run ``impl`` forward on the case's inputs (or on the given float64 arrays)."""
    cq, ck, cv, _ = case.inputs()
    return call.run(impl, case, cq if q is None else q, ck if k is None else k, cv if v is None else v)


def backward(impl, case) -> call.Result:
    """Forward, then backward through the case's dO."""
    return call.run(impl, case, *case.inputs())


def masked_rows(case) -> np.ndarray:
    """Indices of query rows that see no key."""
    return np.flatnonzero(~case.visible().any(axis=1))


def masked_keys(case) -> np.ndarray:
    """Indices of keys that no query sees."""
    return np.flatnonzero(~case.visible().any(axis=0))


def kv_heads(case, x):
    """Repeat a (B, Hkv, ...) array so query head h finds its kv head at index h."""
    return np.repeat(x, case.hq // case.hkv, axis=1)
