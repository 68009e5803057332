"""Profile and GAR strip sweep on a Reddit-sized graph (GPU only): the record of the GAT
step profile and of the wide-row experiment noted in
:func:`fusegnn.kernels.spmm_gar.gar_config`.

1. a profile of one GAT (1 head x 16, dropout 0.6) training step, kernel by kernel;
2. GAR SpMM forward at 128 and 256 fp32 features over strip width x tile x warps x
   segment length, against ``torch.sparse.mm`` (cuSPARSE) in the same run.

The committed log (``benchmarks/results/gpu-checks/tiles-nvidia-h200.log``) also holds a
sweep of the fused GAT op over ``block_e`` x ``num_warps`` shared by its three kernels,
run by the first version of this script (commit cfa0d04); the per-kernel sweep of
``benchmarks/tiles_gpu_kernels.py`` replaced it.

Run from the repository root: ``PYTHONUNBUFFERED=1 python3 benchmarks/tiles_gpu.py``;
writes ``$OUT/sweep1.json`` (log on stdout).
"""
import os, sys, json
sys.path.insert(0, os.getcwd())
import torch, torch.nn.functional as F
from triton.testing import do_bench
from fusegnn.datasets.synthetic import generate_reddit_like
from fusegnn.sparse import Graph
from fusegnn.sparse.processing import remove_self_loops, add_self_loops
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
# ---- GAR wide-F
from fusegnn.kernels.partition import plan_for
from fusegnn.kernels.spmm_gar import gar_config, gar_reduce
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
