"""Draws the pictures in docs/img/ as plain SVG (no plotting library): python docs/figures.py

- causal-masks.svg: bottom-right against top-left alignment, and rows that see no key;
- rounding-model.svg: where a fused low-precision kernel rounds, which the oracle budgets for;
- failure-causal-per-tile.svg: a real failure, the error of a broken kernel's output per entry
  (mutants/tiled.py:causal_per_tile, which masks per tile instead of per element).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the checkout: mutants/ is not part of the installed package

CELL = 22
FONT = 'font-family="DejaVu Sans, Arial, sans-serif"'


def _svg(width, height, body):
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}">\n<rect width="100%" height="100%" fill="white"/>\n'
            + "\n".join(body) + "\n</svg>\n")


def _text(x, y, s, size=13, anchor="start", weight="normal"):
    s = s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return f'<text x="{x}" y="{y}" {FONT} font-size="{size}" text-anchor="{anchor}" font-weight="{weight}">{s}</text>'


def _grid(x0, y0, visible, title, note):
    sq, sk = visible.shape
    body = [_text(x0, y0 - 30, title, 14, weight="bold"), _text(x0, y0 - 12, note, 12)]
    for i in range(sq):
        body.append(_text(x0 - 6, y0 + i * CELL + 15, str(i), 11, "end"))
        seen = visible[i].any()
        for j in range(sk):
            fill = "#3b6fb6" if visible[i, j] else ("#f2d0d0" if not seen else "#e8e8e8")
            body.append(f'<rect x="{x0 + j * CELL}" y="{y0 + i * CELL}" width="{CELL - 2}" height="{CELL - 2}" '
                        f'fill="{fill}"/>')
    for j in range(sk):
        body.append(_text(x0 + j * CELL + 10, y0 + sq * CELL + 14, str(j), 11, "middle"))
    body.append(_text(x0 + sk * CELL / 2, y0 + sq * CELL + 30, "key j", 12, "middle"))
    return body


def causal_masks():
    def vis(sq, sk, align):
        i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
        return j <= i + (sk - sq if align == "bottom_right" else 0)

    body = [_text(20, 24, "Causal masks when Sq != Sk (blue: query row i sees key j)", 15, weight="bold")]
    body += _grid(40, 90, vis(4, 7, "bottom_right"), "bottom-right (FlashAttention >= 2.1)",
                  "j <= i + Sk - Sq: the last query sees every key")
    body += _grid(360, 90, vis(4, 7, "top_left"), "top-left (SDPA is_causal)", "j <= i: keys 4-6 are seen by nobody")
    body += _grid(680, 90, vis(6, 3, "bottom_right"), "bottom-right, Sq > Sk",
                  "rows 0-2 see no key (red): O = 0, LSE = -inf")
    body.append(_text(20, 276, "Query row i runs down the side of each grid. With Sq = Sk both alignments are the "
                               "same mask,", 12))
    body.append(_text(20, 294, "which is why a test that only draws square cases cannot tell them apart.", 12))
    return _svg(960, 310, body)


def rounding_model():
    boxes = [
        ("q, k, v", "stored in t", "#eeeeee"),
        ("S = scale * q k^T", "products summed in fp32", "#dde8f6"),
        ("m, l per row", "running max and sum, fp32", "#dde8f6"),
        ("P = exp(S - m)", "rounded to t before P V", "#f6e3c8"),
        ("acc = P V", "summed in fp32", "#dde8f6"),
        ("O = acc / l", "rounded to t when stored", "#f6e3c8"),
    ]
    body = [_text(20, 26, "Where a fused fp16/bf16 kernel rounds (t = the input dtype)", 15, weight="bold")]
    x = 20
    for i, (head, sub, fill) in enumerate(boxes):
        body.append(f'<rect x="{x}" y="50" width="148" height="58" rx="6" fill="{fill}" stroke="#555"/>')
        body.append(_text(x + 74, 74, head, 13, "middle", "bold"))
        body.append(_text(x + 74, 94, sub, 10.5, "middle"))
        if i < len(boxes) - 1:
            body.append(f'<path d="M{x + 150} 79 L{x + 166} 79" stroke="#333" stroke-width="2" '
                        'marker-end="url(#arrow)"/>')
        x += 171
    body.insert(0, '<defs><marker id="arrow" markerWidth="8" markerHeight="8" refX="6" refY="3" orient="auto">'
                   '<path d="M0,0 L6,3 L0,6 z" fill="#333"/></marker></defs>')
    notes = [
        "blue: fp32 arithmetic. A logit carries an absolute error of about eps(fp32) * |logit|, and exp() turns it",
        "into a relative error of the weight: the budget grows with the largest |logit| L.",
        "orange: a rounding to t. P in t costs half a t-spacing per weight, so O can be off by about eps(t) times",
        "sum_j P_ij |v_j|, the size of the sum that forms it; storing O in t adds half a spacing per entry.",
        "LSE = m + log l stays in fp32. The backward rounds dS before its products the same way.",
        "flashcheck's oracle budgets for these roundings per entry; anything past that budget is a bug (docs/oracle.md).",
    ]
    for k, line in enumerate(notes):
        body.append(_text(20, 140 + 18 * k, line, 12))
    return _svg(1040, 260, body)


def real_failure():
    from flashcheck.contract import load
    from flashcheck.oracle import entries as check_entries
    from flashcheck.strategies import AttentionCase

    impl = load(str(HERE.parent / "mutants" / "tiled.py") + ":causal_per_tile")
    case = AttentionCase(sq=12, sk=12, d=4, dv=6, causal="bottom_right", block_q=4, block_k=4, seed=3)
    from flashcheck.contract import call

    res = call.run(impl, case, *case.inputs()[:3])
    e = check_entries(case, "o", res.o)
    with np.errstate(divide="ignore"):
        ratio = np.log10(np.maximum(e.err[0, 0], 1e-30) / e.limit[0, 0])
    body = [_text(20, 24, "A real failure: causal mask applied per 4x4 tile instead of per element", 15,
                  weight="bold"),
            _text(20, 44, f"{impl.name} on AttentionCase(sq=12, sk=12, d=4, dv=6, causal='bottom_right', "
                          "block_q=4, block_k=4, seed=3):", 12),
            _text(20, 62, "the error of each entry of O against the oracle's bound for it", 12)]
    x0, y0 = 90, 84
    for i in range(case.sq):
        body.append(_text(x0 - 8, y0 + i * CELL + 15, f"row {i}", 11, "end"))
        for j in range(case.dv):
            r = ratio[i, j]
            if e.wrong[0, 0, i, j]:
                shade = int(255 - min(1.0, r / 16) * 180)
                fill = f"rgb(255,{shade},{shade // 2})" if r < 16 else "rgb(200,30,30)"
            else:
                fill = "#d9ead3"
            body.append(f'<rect x="{x0 + j * CELL}" y="{y0 + i * CELL}" width="{CELL - 2}" height="{CELL - 2}" '
                        f'fill="{fill}"/>')
        if i % case.block_q == 0 and i:
            body.append(f'<line x1="{x0 - 4}" x2="{x0 + case.dv * CELL}" y1="{y0 + i * CELL - 1}" '
                        f'y2="{y0 + i * CELL - 1}" stroke="#333" stroke-dasharray="3,2"/>')
    body.append(_text(x0 + case.dv * CELL / 2, y0 + case.sq * CELL + 16, "value dim", 12, "middle"))
    wrong_rows = [int(i) for i in np.flatnonzero(e.wrong[0, 0].any(axis=1))]
    lines = [
        "green: within the oracle's bound; red: wrong (darker = further past it).",
        "Dashed lines: the kernel's query tiles. A tile on the diagonal is kept whole",
        "once any of it is visible, so every row of it but the last also sees the keys",
        f"above the diagonal: rows {wrong_rows} are wrong, each tile's last row is right.",
        "flashcheck prints the same pattern as text:",
        "  wrong o by query row (X wrong, . right; | every 4): " + _row_map(e.wrong[0, 0].any(axis=1), 4),
        "and writes this picture as error.png in the reproducer where matplotlib is installed.",
    ]
    for k, line in enumerate(lines):
        body.append(_text(x0 + case.dv * CELL + 30, y0 + 20 + 20 * k, line, 12))
    return _svg(900, y0 + case.sq * CELL + 30, body)


def _row_map(rows, block):
    return "".join(("|" if i and i % block == 0 else "") + ("X" if w else ".") for i, w in enumerate(rows))


def main():
    out = HERE / "img"
    out.mkdir(exist_ok=True)
    for name, draw in (("causal-masks.svg", causal_masks), ("rounding-model.svg", rounding_model),
                       ("failure-causal-per-tile.svg", real_failure)):
        (out / name).write_text(draw())
        print(f"wrote {out / name}")


if __name__ == "__main__":
    main()
