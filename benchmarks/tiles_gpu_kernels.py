"""Per-kernel launch-shape sweep of the fused GAT op on a Reddit-sized graph (GPU only).

Times a GAT training step (1 x 16, 8 x 16, 1 x 64) with the current defaults, then, at
1 x 16, 1 x 48 and 8 x 8, varies ``(block_e, num_warps)`` of one kernel at a time
(forward; backward pass R over the CSR; backward pass C over the CSC) with the other
two at their defaults, and times the best combination. The record behind
:func:`fusegnn.kernels.gat_fused._block_sizes`
(``benchmarks/results/gpu-checks/tiles2-nvidia-h200.log``).

Run from the repository root: ``PYTHONUNBUFFERED=1 python3 benchmarks/tiles_gpu_kernels.py``;
writes ``$OUT/sweep2.json``.
"""
import os, sys, json
sys.path.insert(0, os.getcwd())
import torch, torch.nn.functional as F
from triton.testing import do_bench
from fusegnn.datasets.synthetic import generate_reddit_like
from fusegnn.sparse import Graph
from fusegnn.sparse.processing import remove_self_loops, add_self_loops
from fusegnn.kernels import gat_fused
from fusegnn.kernels.gat_fused import fused_gat_attention
OUT = os.environ.get("OUT", ".")
def log(*a): print(*a, flush=True)
def bench(fn, rep=100): return do_bench(fn, warmup=10, rep=rep, return_mode="median")
log(torch.cuda.get_device_name(), torch.__version__)
data = generate_reddit_like(scale=1.0, seed=0, device="cuda")
g0 = Graph(data.edge_index, data.x.size(0))
graph = add_self_loops(remove_self_loops(g0)); N = graph.num_nodes
R = {}
from fusegnn.models import GAT
train = data.train_mask.nonzero().view(-1); ytr = data.y[train]
for heads, hid in ((1, 16), (8, 16), (1, 64)):
    torch.manual_seed(0)
    model = GAT(data.x.size(1), hid, data.num_classes, heads=heads, out_heads=1, dropout=0.6).cuda().train()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    def step():
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(data.x, g0).index_select(0, train), ytr).backward(); opt.step()
    for _ in range(3): step()
    R[f"step_{heads}x{hid}"] = ms = bench(step, 400)
    log(f"GAT {heads}x{hid} reddit step ms (new defaults) {ms:.2f}")
    del model, opt; torch.cuda.empty_cache()
SL, P = 0.2, 0.6
grid = [(be, nw) for be in (2, 4, 8, 16, 32, 64, 128) for nw in (1, 2, 4)]
for H, C in ((1, 16), (1, 48), (8, 8)):
    h = torch.randn(N, H, C, device="cuda", requires_grad=True)
    s = torch.randn(N, H, device="cuda", requires_grad=True)
    t = torch.randn(N, H, device="cuda", requires_grad=True)
    grad = torch.randn(N, H, C, device="cuda")
    def fb():
        o = fused_gat_attention(graph, h, s, t, SL, P, variant="gar")[0]
        torch.autograd.grad(o, (h, s, t), grad)
    def fw():
        with torch.no_grad(): fused_gat_attention(graph, h, s, t, SL, P, variant="gar")
    cfg = gat_fused._Config(graph, h.detach(), s.dtype, SL, P, None, "gar", gat_fused.DEFAULT_CHUNK)
    d = dict(fwd=tuple(cfg.fwd), row=tuple(cfg.row), col=tuple(cfg.col))
    base_fw, base_fb = bench(fw), bench(fb)
    log(f"H{H} C{C} defaults {d}: fwd {base_fw:.3f} fb {base_fb:.3f}")
    res = dict(defaults=d, fwd_ms=base_fw, fb_ms=base_fb, fwd={}, row={}, col={})
    for kern in ("fwd", "row", "col"):
        for be, nw in grid:
            if be * gat_fused.next_pow2(H) * gat_fused.next_pow2(C) > 8192: continue
            with gat_fused.tuning(**{kern: (be, nw)}):
                try: ms = bench(fw if kern == "fwd" else fb, 60)
                except Exception as e: log("fail", kern, be, nw, type(e).__name__); continue
            res[kern][f"{be}x{nw}"] = ms
        best = min(res[kern].items(), key=lambda kv: kv[1])
        log(f"  H{H} C{C} {kern}: best {best}  all " + " ".join(f"{k}:{v:.2f}" for k, v in res[kern].items()))
    bf = min(res["fwd"], key=res["fwd"].get); br = min(res["row"], key=res["row"].get); bc = min(res["col"], key=res["col"].get)
    tup = lambda k: tuple(int(v) for v in k.split("x"))
    with gat_fused.tuning(fwd=tup(bf), row=tup(br), col=tup(bc)):
        res["best_combo_fb"] = bench(fb)
    log(f"== H{H} C{C} default fb {base_fb:.3f}; best combo fwd {bf} row {br} col {bc}: fb {res['best_combo_fb']:.3f}")
    R[f"H{H}C{C}"] = res
    del h, s, t, grad; torch.cuda.empty_cache()
json.dump(R, open(os.path.join(OUT, "sweep2.json"), "w"), indent=1)
log("done")
