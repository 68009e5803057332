"""Launch-shape sweep on a Reddit-sized graph (GPU only), the record behind the tiles of
:func:`fusegnn.kernels.gat_fused._block_sizes` and of wide rows in
:func:`fusegnn.kernels.spmm_gar.gar_config`.

1. a profile of one GAT (1 head x 16, dropout 0.6) training step, kernel by kernel;
2. the fused GAT op, forward and forward + backward, over ``block_e`` x ``num_warps``
   (shared by the three kernels) then ``chunk``, at 1 x 16, 1 x 48 and 8 x 8;
3. GAR SpMM forward at 128 and 256 fp32 features over strip width x tile x warps x
   segment length, against ``torch.sparse.mm`` (cuSPARSE) in the same run.

Run from the repository root: ``PYTHONUNBUFFERED=1 python3 benchmarks/tiles_gpu.py``;
writes ``$OUT/sweep1.json`` (log on stdout).
"""
import os, sys, time, json, statistics
sys.path.insert(0, os.getcwd())
import torch, torch.nn.functional as F
from triton.testing import do_bench
from fusegnn.datasets.synthetic import generate_reddit_like
from fusegnn.sparse import Graph
from fusegnn.sparse.processing import remove_self_loops, add_self_loops
from fusegnn.kernels import gat_fused
from fusegnn.kernels.gat_fused import fused_gat_attention
OUT = os.environ.get("OUT", ".")
R = {}
def log(*a):
    print(*a, flush=True)
def bench(fn, rep=150):
    return do_bench(fn, warmup=25, rep=rep, return_mode="median")
log(torch.cuda.get_device_name(), torch.__version__)
data = generate_reddit_like(scale=1.0, seed=0, device="cuda")
g0 = Graph(data.edge_index, data.x.size(0))
graph = add_self_loops(remove_self_loops(g0))
N = graph.num_nodes
log("N", N, "E", graph.num_edges)
# ---- full step profile
from fusegnn.models import GAT
train = data.train_mask.nonzero().view(-1); ytr = data.y[train]
torch.manual_seed(0)
model = GAT(data.x.size(1), 16, data.num_classes, heads=1, out_heads=1, dropout=0.6).cuda().train()
opt = torch.optim.Adam(model.parameters(), lr=0.01)
x = data.x
def step():
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x, g0).index_select(0, train), ytr)
    loss.backward(); opt.step()
for _ in range(3): step()
torch.cuda.synchronize()
R["step_ms"] = bench(step, 500)
log("GAT 1x16 reddit step ms", R["step_ms"])
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    step(); torch.cuda.synchronize()
tab = prof.key_averages().table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=70)
log(tab)
# ---- GAT op sweep per width
SL, P = 0.2, 0.6
sweep = {}
for H, C in ((1, 16), (1, 48), (8, 8)):
    h = torch.randn(N, H, C, device="cuda", requires_grad=True)
    s = torch.randn(N, H, device="cuda", requires_grad=True)
    t = torch.randn(N, H, device="cuda", requires_grad=True)
    grad = torch.randn(N, H, C, device="cuda")
    def fb():
        o = fused_gat_attention(graph, h, s, t, SL, P, variant="gar")[0]
        torch.autograd.grad(o, (h, s, t), grad)
    def fw():
        with torch.no_grad():
            fused_gat_attention(graph, h, s, t, SL, P, variant="gar")
    cfg = gat_fused._Config(graph, h.detach(), s.dtype, SL, P, None, "gar", gat_fused.DEFAULT_CHUNK)
    res = [dict(block_e=cfg.block_e, num_warps=cfg.num_warps, chunk=gat_fused.DEFAULT_CHUNK, default=True, fwd=bench(fw), fb=bench(fb))]
    log(f"H{H} C{C} default", res[0])
    for be in (4, 8, 16, 32, 64, 128):
        if be * max(H, 1) * 16 * max(C // 16, 1) > 8192: continue
        for nw in (1, 2, 4, 8):
            if be * H * C // (nw * 32) < 1 and nw > 1: continue
            with gat_fused.tuning(block_e=be, num_warps=nw):
                try:
                    r = dict(block_e=be, num_warps=nw, chunk=gat_fused.DEFAULT_CHUNK, fwd=bench(fw, 80), fb=bench(fb, 80))
                except Exception as e:
                    log("fail", be, nw, type(e).__name__); continue
            res.append(r); log(f"H{H} C{C}", r)
    best = min(res, key=lambda r: r["fb"])
    for ch in (512, 1024, 4096, 8192):
        with gat_fused.tuning(block_e=best["block_e"], num_warps=best["num_warps"], chunk=ch):
            r = dict(block_e=best["block_e"], num_warps=best["num_warps"], chunk=ch, fwd=bench(fw, 80), fb=bench(fb, 80))
        res.append(r); log(f"H{H} C{C}", r)
    best = min(res, key=lambda r: r["fb"])
    log(f"== H{H} C{C} default fb {res[0]['fb']:.3f} best {best}")
    sweep[f"H{H}C{C}"] = res
    del h, s, t, grad; torch.cuda.empty_cache()
R["gat_sweep"] = sweep
# ---- GAR wide-F
from fusegnn.kernels.partition import plan_for
from fusegnn.kernels.spmm_gar import GarConfig, gar_config, gar_reduce
g = g0
A = torch.sparse_csr_tensor(g.csr.ptr, g.csr.index, torch.ones(g.num_edges, device="cuda"), (N, N))
gar = {}
for feat in (128, 256):
    xx = torch.randn(N, feat, device="cuda")
    cus = bench(lambda: torch.sparse.mm(A, xx))
    base = gar_config(feat, 4, avg_degree=g.avg_degree)
    def run(cfg):
        plan = plan_for(g, "csr", cfg.seg_len)
        return gar_reduce(plan, xx, None, N, 1, xx.dtype, config=cfg)[0]
    ref = torch.sparse.mm(A, xx)
    assert torch.allclose(run(base), ref, rtol=1e-4, atol=1e-3)
    res = [dict(cfg=base._asdict(), ms=min(bench(lambda: run(base)) for _ in range(2)), default=True)]
    log(f"F{feat} cusparse {cus:.3f} default {res[0]}")
    for bf in (32, 64, 128):
        for tile in (1024, 2048, 4096):
            for nw in (4, 8):
                for sl in (1024, 4096):
                    cfg = base._replace(block_f=bf, block_e=max(tile // bf, 1), num_warps=nw, seg_len=sl)
                    try:
                        ms = min(bench(lambda: run(cfg)) for _ in range(2))
                    except Exception as e:
                        log("fail", cfg, type(e).__name__); continue
                    res.append(dict(cfg=cfg._asdict(), ms=ms)); log(f"F{feat}", res[-1])
    best = min(res, key=lambda r: r["ms"])
    log(f"== F{feat} cusparse {cus:.3f} default {res[0]['ms']:.3f} ({cus/res[0]['ms']:.2f}x) best {best['ms']:.3f} ({cus/best['ms']:.2f}x) {best['cfg']}")
    gar[f"F{feat}"] = dict(cusparse=cus, trials=res)
R["gar_sweep"] = gar
json.dump(R, open(os.path.join(OUT, "sweep1.json"), "w"), indent=1, default=str)
log("done")
