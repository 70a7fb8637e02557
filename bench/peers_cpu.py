#!/usr/bin/env python
"""CPU peer benchmark: zerotrain stages 0/1/2 against their torch counterparts, on gloo.

Every peer trains the same small GPT (token + learned position embeddings, N pre-LN blocks
with causal self-attention and a GELU MLP, untied or tied head, cross-entropy) from the same
seed on the same deterministic data with AdamW (lr 1e-3, betas 0.9/0.95, eps 1e-8, wd 0.1)
at world size 2 on gloo. Each peer runs in its own world: two ranks spawned with
torch.multiprocessing (start method "spawn"), rendezvous through a FileStore in a temporary
directory (no TCP store, no ports), one torch thread per rank.

Peers (``--peers``, comma list; see ``--list-peers``):

  ddp            torch DistributedDataParallel + AdamW (the parity reference)
  torch_zero     DDP + torch.distributed.optim.ZeroRedundancyOptimizer(AdamW)
  fsdp2          fully_shard(block) for each block, then fully_shard(root),
                 reshard_after_forward=False (the closest torch analogue of ZeRO-2)
  fsdp2_bf16     the same with MixedPrecisionPolicy(param bf16, reduce fp32): the
                 comparison for zt_z2_bf16 (CPU bf16 matmuls are slow without AVX512-BF16/AMX)
  zt_z0/1/2      zerotrain stage 0/1/2, fp32, reduce/allgather buckets 5e6 elements
  zt_z*_overlap  the same with zero_optimization.overlap_comm = true
  zt_z2_bf16     zerotrain stage 2 with "bf16": {"enabled": true} (fp32 master + Adam)
  zt_z3          zerotrain stage 3 with overlap_comm (prefetch) and every parameter
                 partitioned; compared with fsdp2_reshard
  fsdp2_reshard  fsdp2 with reshard_after_forward=True (parameters re-gathered in
                 backward): the torch analogue of ZeRO-3

Reported per peer:

  median step time: per step the max over ranks of forward + backward + optimizer step,
      warm-up steps (--warmup, default 2) excluded; also the median of each phase;
  ratio to the torch peer of the same stage (0: ddp, 1: torch_zero, 2: fsdp2; the bf16
      row: fsdp2_bf16 when it ran);
  bytes per rank of parameters / gradients / optimizer state, measured after the last
      step's backward and before its optimizer step. zerotrain: engine.memory_breakdown().
      torch peers: distinct tensor storages of the parameters (DTensor: local shard), their
      .grad, and optimizer.state (ZeroRedundancyOptimizer: its local .optim.state). DDP's
      reducer buckets live in C++ and are not visible to either count;
  live tensors: every distinct storage reachable from Python (gc) at that point, a check
      that no category hides memory;
  peak RSS per rank (getrusage ru_maxrss);
  final loss (mean over ranks of the last step's loss), max |loss - ddp loss| over steps;
  max |param - ddp param| after the last step (full parameters; FSDP2 via full_tensor()).

  also: min step time, CPU seconds per step (process time, max over ranks), and the
      cores other processes kept busy while the peer ran ("other load"): on a shared
      machine, time rows with other load above ~0.3 are slowed by co-tenants.

A peer that fails or times out becomes a row with its error. zerotrain is imported from a
copy of its source taken at the start (--no-snapshot: from the working tree), so every row
of a run measures the same code. --rounds N repeats the peer list and keeps each peer's
fastest round; --wait-quiet S waits up to S seconds before each peer for a quiet machine.

Example:
  python bench/peers_cpu.py --json-out /tmp/peers.json --md-out /tmp/peers.md
  python bench/peers_cpu.py --peers ddp,zt_z2 --steps 10 --layers 2
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import resource
import shutil
import sys
import tempfile
import time
import traceback

# --------------------------------------------------------------------------------------
# Peers
# --------------------------------------------------------------------------------------
PEERS: dict[str, tuple[str, dict]] = {
    "ddp": ("ddp", {}),
    "torch_zero": ("torch_zero", {}),
    "fsdp2": ("fsdp2", {}),
    "fsdp2_bf16": ("fsdp2", {"bf16": True}),
    "fsdp2_reshard": ("fsdp2", {"reshard": True}),  # full resharding: the ZeRO-3 analogue
    "zt_z0": ("zerotrain", {"stage": 0}),
    "zt_z1": ("zerotrain", {"stage": 1}),
    "zt_z2": ("zerotrain", {"stage": 2}),
    "zt_z0_overlap": ("zerotrain", {"stage": 0, "overlap": True}),
    "zt_z1_overlap": ("zerotrain", {"stage": 1, "overlap": True}),
    "zt_z2_overlap": ("zerotrain", {"stage": 2, "overlap": True}),
    "zt_z2_bf16": ("zerotrain", {"stage": 2, "bf16": True}),
    "zt_z3": ("zerotrain", {"stage": 3, "overlap": True}),
}
DEFAULT_PEERS = ["ddp", "torch_zero", "fsdp2", "fsdp2_reshard", "zt_z0", "zt_z1", "zt_z2",
                 "zt_z0_overlap", "zt_z1_overlap", "zt_z2_overlap", "zt_z3", "fsdp2_bf16",
                 "zt_z2_bf16"]
TORCH_PEER_OF_STAGE = {0: "ddp", 1: "torch_zero", 2: "fsdp2", 3: "fsdp2_reshard"}
PARITY_PEER = "ddp"


def torch_peer_for(peer: str, available) -> str:
    """The torch peer a zerotrain row is compared with: same stage; bf16 rows prefer the
    bf16 FSDP2 run when there is one (bf16 matmuls cost very differently on CPU)."""
    if PEERS[peer][1].get("bf16") and "fsdp2_bf16" in available:
        return "fsdp2_bf16"
    return TORCH_PEER_OF_STAGE[stage_of(peer)]


def stage_of(peer: str):
    kind, opts = PEERS[peer]
    if kind == "zerotrain":
        return opts["stage"]
    if kind == "fsdp2" and opts.get("reshard"):
        return 3
    return {"ddp": 0, "torch_zero": 1, "fsdp2": 2}[kind]


def zerotrain_root():
    import importlib.util
    spec = importlib.util.find_spec("zerotrain")  # does not import it
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def snapshot_zerotrain(base):
    """Copy zerotrain's package into base and put it first on sys.path (spawned ranks
    inherit sys.path), so that every row of one run measures the same code even while the
    working tree is being edited. Returns the snapshot's package directory."""
    root = zerotrain_root()
    if root is None:
        return None
    dst = os.path.join(base, "zerotrain_snapshot")
    shutil.copytree(root, os.path.join(dst, "zerotrain"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    sys.path.insert(0, dst)
    os.environ["PYTHONPATH"] = dst + os.pathsep + os.environ.get("PYTHONPATH", "")
    return os.path.join(dst, "zerotrain")


def zerotrain_digest(root=None):
    """sha256 (12 hex) over zerotrain's source files: which code a run measured."""
    import hashlib
    root = root or zerotrain_root()
    if root is None:
        return None
    h = hashlib.sha256()
    for dirpath, dirnames, files in sorted(os.walk(root)):
        dirnames.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                h.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()[:12]


# --------------------------------------------------------------------------------------
# Model and data
# --------------------------------------------------------------------------------------
def build_model(cfg):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self, d, heads):
            super().__init__()
            self.heads = heads
            self.ln1 = nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
            self.ln2 = nn.LayerNorm(d)
            self.fc = nn.Linear(d, 4 * d)
            self.out = nn.Linear(4 * d, d)

        def forward(self, x):
            B, T, C = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
            q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2)
                       for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self, layers, d, heads, vocab, seq, tie):
            super().__init__()
            self.wte = nn.Embedding(vocab, d)
            self.wpe = nn.Embedding(seq, d)
            self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
            self.ln_f = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab, bias=False)
            if tie:
                self.head.weight = self.wte.weight

        def forward(self, idx, targets):
            pos = torch.arange(idx.shape[1], device=idx.device)
            x = self.wte(idx) + self.wpe(pos)
            for block in self.blocks:
                x = block(x)
            logits = self.head(self.ln_f(x)).float()
            return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))

    torch.manual_seed(cfg["seed"])
    model = GPT(cfg["layers"], cfg["d_model"], cfg["heads"], cfg["vocab"], cfg["seq"],
                cfg["tie_head"])
    with torch.no_grad():  # GPT-2 style init, deterministic
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
            elif name.endswith("bias"):
                p.zero_()
    return model


def make_batches(cfg, rank, world):
    """This rank's (inputs, targets) for every step: deterministic, learnable tokens (an
    affine recurrence modulo vocab with 10% random tokens), the global batch split by rank."""
    import torch
    out = []
    n, T, V, b = world * cfg["batch"], cfg["seq"], cfg["vocab"], cfg["batch"]
    for step in range(cfg["steps"]):
        g = torch.Generator().manual_seed(cfg["seed"] * 1_000_003 + step)
        toks = torch.empty(n, T + 1, dtype=torch.long)
        toks[:, 0] = torch.randint(0, V, (n,), generator=g)
        noise = torch.rand(n, T + 1, generator=g) < 0.1
        rnd = torch.randint(0, V, (n, T + 1), generator=g)
        for t in range(1, T + 1):
            toks[:, t] = torch.where(noise[:, t], rnd[:, t], (toks[:, t - 1] * 31 + 17) % V)
        mine = toks[rank * b:(rank + 1) * b]
        out.append((mine[:, :-1].contiguous(), mine[:, 1:].contiguous()))
    return out


def adamw_kwargs(cfg):
    return dict(lr=cfg["lr"], betas=(0.9, 0.95), eps=1e-8, weight_decay=cfg["weight_decay"])


# --------------------------------------------------------------------------------------
# Memory accounting (torch peers): distinct storages
# --------------------------------------------------------------------------------------
def _local(t):
    try:
        from torch.distributed.tensor import DTensor
        if isinstance(t, DTensor):
            return t._local_tensor
    except ImportError:
        pass
    return t


class StorageCount:
    """Bytes of distinct storages; a storage counts once, in the first category seen."""

    def __init__(self):
        self.seen = set()
        self.bytes = {}

    def add(self, cat, tensors):
        import torch
        total = self.bytes.setdefault(cat, 0)
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            t = _local(t)
            if t.is_meta:
                continue
            s = t.untyped_storage()
            key = (str(t.device), s.data_ptr())
            if s.nbytes() == 0 or key in self.seen:
                continue
            self.seen.add(key)
            total += s.nbytes()
        self.bytes[cat] = total


def torch_peer_memory(model, optimizer):
    params = list(model.parameters())
    states = [optimizer.state]
    inner = getattr(optimizer, "optim", None)  # ZeroRedundancyOptimizer's local optimizer
    if inner is not None and hasattr(inner, "state"):
        states.append(inner.state)
    c = StorageCount()
    c.add("parameters", params)
    c.add("gradients", [p.grad for p in params])
    c.add("optimizer_state", [v for st in states for s in st.values() for v in s.values()])
    return c.bytes


def live_tensor_bytes():
    import torch
    c = StorageCount()
    objs = []
    for o in gc.get_objects():
        try:
            if isinstance(o, torch.Tensor):
                objs.append(o)
        except Exception:  # noqa: BLE001
            pass
    c.add("all", objs)
    return c.bytes["all"]


# --------------------------------------------------------------------------------------
# Runners: each returns an object with forward(x, y) -> loss tensor, backward(loss),
# step(), memory() -> dict, full_params() -> [(name, tensor)] (collective for FSDP2).
# --------------------------------------------------------------------------------------
class TorchRunner:
    def __init__(self, module, model, optimizer):
        self.module, self.model, self.opt = module, model, optimizer

    def forward(self, x, y):
        self.opt.zero_grad(set_to_none=True)
        return self.module(x, y)

    def backward(self, loss):
        loss.backward()

    def step(self):
        self.opt.step()

    def memory(self):
        return torch_peer_memory(self.model, self.opt)

    def full_params(self):
        return [(n, _full(p)) for n, p in self.model.named_parameters()]


def _full(p):
    try:
        from torch.distributed.tensor import DTensor
        if isinstance(p, DTensor):
            return p.full_tensor()
    except ImportError:
        pass
    return p.detach()


def make_ddp(cfg, opts):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = build_model(cfg)
    ddp = DDP(model)
    return TorchRunner(ddp, model, torch.optim.AdamW(ddp.parameters(), **adamw_kwargs(cfg)))


def make_torch_zero(cfg, opts):
    import torch
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = build_model(cfg)
    ddp = DDP(model)
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW,
                                  **adamw_kwargs(cfg))
    return TorchRunner(ddp, model, opt)


def make_fsdp2(cfg, opts):
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    model = build_model(cfg)
    kw = {"reshard_after_forward": bool(opts.get("reshard"))}
    if opts.get("bf16"):  # bf16 compute, fp32 sharded parameters/optimizer, fp32 reduction
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return TorchRunner(model, model, torch.optim.AdamW(model.parameters(), **adamw_kwargs(cfg)))


class ZeroTrainRunner:
    def __init__(self, cfg, opts):
        import zerotrain
        model = build_model(cfg)
        b = int(cfg["bucket_elems"])
        config = {
            "train_micro_batch_size_per_gpu": cfg["batch"],
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0,
            "steps_per_print": 10 ** 9,
            "optimizer": {"type": "AdamW", "params": {
                "lr": cfg["lr"], "betas": [0.9, 0.95], "eps": 1e-8,
                "weight_decay": cfg["weight_decay"]}},
            "zero_optimization": {"stage": opts["stage"], "reduce_bucket_size": b,
                                  "allgather_bucket_size": b,
                                  "overlap_comm": bool(opts.get("overlap")),
                                  # shard every parameter, as FSDP2 does
                                  "stage3_param_persistence_threshold": 0},
        }
        if opts.get("bf16"):
            config["bf16"] = {"enabled": True, "auto_cast": True}
        self.engine, _, _, _ = zerotrain.initialize(
            model=model, model_parameters=model.parameters(), config=config)
        self.config = config

    def forward(self, x, y):
        return self.engine(x, y)

    def backward(self, loss):
        self.engine.backward(loss)

    def step(self):
        self.engine.step()

    def memory(self):
        return dict(self.engine.memory_breakdown())

    def full_params(self):  # collective at stage 3; stages 0-2 hold full parameters
        import zerotrain
        named = list(self.engine.module.named_parameters())
        with zerotrain.zero.GatheredParameters([p for _, p in named]):
            return [(n, p.detach().float().clone()) for n, p in named]


RUNNERS = {"ddp": make_ddp, "torch_zero": make_torch_zero, "fsdp2": make_fsdp2,
           "zerotrain": ZeroTrainRunner}


# --------------------------------------------------------------------------------------
# One rank
# --------------------------------------------------------------------------------------
def rank_main(rank, peer, cfg, workdir):
    out = {"rank": rank, "ok": False, "t": {"start": time.time()}}
    t_fail = None
    try:
        import torch
        import torch.distributed as dist
        torch.set_num_threads(cfg["threads"])
        world = cfg["world_size"]
        store = dist.FileStore(os.path.join(workdir, "filestore"), world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=cfg["coll_timeout"]))
        out["t"]["pg_ready"] = time.time()
        out["rss_after_init"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        kind, opts = PEERS[peer]
        batches = make_batches(cfg, rank, world)
        runner = RUNNERS[kind](cfg, opts)
        out["t"]["runner_ready"] = time.time()
        losses, times, phases, cpu, mem = [], [], [], [], None
        for i, (x, y) in enumerate(batches):
            dist.barrier()  # start every step together (outside the timed region)
            c0 = time.process_time()
            t0 = time.perf_counter()
            loss = runner.forward(x, y)
            t1 = time.perf_counter()
            runner.backward(loss)
            t2 = time.perf_counter()
            c1 = time.process_time()
            if i == len(batches) - 1:  # after the last backward, before its step; untimed
                mem = runner.memory()
                mem["live_tensors"] = live_tensor_bytes()
            c2 = time.process_time()
            t3 = time.perf_counter()
            runner.step()
            t4 = time.perf_counter()
            cpu.append((c1 - c0) + (time.process_time() - c2))
            losses.append(float(loss.detach().float().item()))
            times.append((t2 - t0) + (t4 - t3))
            phases.append((t1 - t0, t2 - t1, t4 - t3))
        out["t"]["loop_done"] = time.time()
        full = runner.full_params()  # collective for FSDP2: every rank calls it
        if rank == 0:
            torch.save({n: t.detach().float().cpu().clone() for n, t in full},
                       os.path.join(workdir, "params.pt"))
        if "zerotrain" in sys.modules:
            out["zerotrain_file"] = sys.modules["zerotrain"].__file__
        out.update(ok=True, losses=losses, times=times, phases=phases, cpu=cpu, mem=mem,
                   n_params=sum(t.numel() for _, t in full))
    except BaseException as e:  # noqa: BLE001
        t_fail = time.time()
        msg = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        out.update(ok=False, error=f"{type(e).__name__}: {msg}",
                   traceback=traceback.format_exc()[-4000:], t_fail=t_fail)
    out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out["t"]["end"] = time.time()
    with open(os.path.join(workdir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    if not out["ok"]:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # do not wait on a rank stuck in a collective; the parent kills it
    try:
        import torch.distributed as dist
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


# --------------------------------------------------------------------------------------
# Parent
# --------------------------------------------------------------------------------------
def run_peer(peer, cfg, base):
    import torch.multiprocessing as mp
    workdir = os.path.join(base, peer)
    os.makedirs(workdir, exist_ok=True)
    t0 = time.time()
    timed_out, spawn_error = False, None
    ctx = mp.start_processes(rank_main, args=(peer, cfg, workdir), nprocs=cfg["world_size"],
                             join=False, start_method="spawn")
    deadline = t0 + cfg["timeout"]
    try:
        while not ctx.join(timeout=1.0):
            if time.time() > deadline:
                timed_out = True
                break
    except Exception as e:  # noqa: BLE001  (a rank exited non-zero: its file has the error)
        spawn_error = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
    for p in ctx.processes:  # only our own children, by handle
        if p.is_alive():
            p.terminate()
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
    wall = time.time() - t0
    ranks = []
    for r in range(cfg["world_size"]):
        f = os.path.join(workdir, f"rank{r}.json")
        if os.path.exists(f):
            ranks.append(json.load(open(f)))
    row = {"peer": peer, "stage": stage_of(peer), "wall_s": round(wall, 1),
           "options": PEERS[peer][1], "kind": PEERS[peer][0]}
    bad = sorted((r for r in ranks if not r.get("ok")), key=lambda r: r.get("t_fail", 0))
    if bad or timed_out or len(ranks) < cfg["world_size"]:
        if bad:
            err = f"rank {bad[0]['rank']}: {bad[0]['error']}"
            row["traceback"] = bad[0].get("traceback")
        elif timed_out:
            err = f"timeout after {cfg['timeout']}s"
        else:
            err = spawn_error or "a rank died without writing its result"
        row.update(status="FAILED", error=err,
                   peak_rss=[r.get("peak_rss") for r in ranks])
        return row
    ranks.sort(key=lambda r: r["rank"])
    n = len(ranks[0]["times"])
    step_max = [max(r["times"][i] for r in ranks) for i in range(n)]
    timed = step_max[cfg["warmup"]:] if n > cfg["warmup"] else step_max
    phase_med = []
    for k in range(3):
        per_step = [max(r["phases"][i][k] for r in ranks) for i in range(n)]
        per_step = per_step[cfg["warmup"]:] if n > cfg["warmup"] else per_step
        phase_med.append(_median(per_step))
    losses = [sum(r["losses"][i] for r in ranks) / len(ranks) for i in range(n)]
    row["startup_s"] = {k: round(max(r["t"][k] for r in ranks) - t0, 2)
                        for k in ("start", "pg_ready", "runner_ready", "loop_done", "end")}
    cpu_max = [max(r["cpu"][i] for r in ranks) for i in range(n)]
    row.update(
        status="ok", median_step_s=_median(timed), step_times_max_over_ranks=step_max,
        min_step_s=min(timed),
        median_cpu_s=_median(cpu_max[cfg["warmup"]:] if n > cfg["warmup"] else cpu_max),
        phase_median_s={"forward": phase_med[0], "backward": phase_med[1],
                        "optimizer_step": phase_med[2]},
        losses=losses, final_loss=losses[-1],
        memory=[r["mem"] for r in ranks], peak_rss=[r["peak_rss"] for r in ranks],
        n_params=ranks[0]["n_params"], params_path=os.path.join(workdir, "params.pt"),
        zerotrain_file=ranks[0].get("zerotrain_file"))
    return row


def _cpu_snapshot():
    """(busy CPU seconds of the whole machine, CPU seconds of our finished children, time)."""
    busy = None
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        idle = v[3] + (v[4] if len(v) > 4 else 0)
        busy = (sum(v[:8]) - idle) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        pass
    ch = resource.getrusage(resource.RUSAGE_CHILDREN)
    me = resource.getrusage(resource.RUSAGE_SELF)
    return busy, ch.ru_utime + ch.ru_stime + me.ru_utime + me.ru_stime, time.time()


def _other_load(a, b):
    """Average number of cores kept busy by processes other than this harness and its
    ranks while a peer ran (co-tenants): a contention indicator for the timings."""
    if a[0] is None or b[0] is None or b[2] <= a[2]:
        return None
    return round(max(0.0, ((b[0] - a[0]) - (b[1] - a[1])) / (b[2] - a[2])), 2)


def wait_for_quiet(max_wait, threshold, window=2.0):
    """Wait (at most max_wait seconds) until other processes keep fewer than `threshold`
    cores busy over a `window`-second sample. Returns the seconds waited."""
    t0 = time.time()
    while time.time() - t0 < max_wait:
        a = _cpu_snapshot()
        time.sleep(window)
        load = _other_load(a, _cpu_snapshot())
        if load is None or load < threshold:
            break
    return round(time.time() - t0, 1)


def _median(xs):
    xs = sorted(xs)
    if not xs:
        return None
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else 0.5 * (xs[m - 1] + xs[m])


def param_diff(path_a, path_b):
    import torch
    a, b = torch.load(path_a), torch.load(path_b)
    if set(a) != set(b):
        raise ValueError(f"parameter names differ: {sorted(set(a) ^ set(b))[:4]}")
    return max((a[k] - b[k]).abs().max().item() for k in a)


def machine_line():
    import torch
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return (f"cpu count {os.cpu_count()}" + (f" ({cpu})" if cpu else "")
            + f", torch {torch.__version__}, python {platform.python_version()}, "
            f"{platform.platform()}")


def _mib_per_rank(values):
    if not values or any(v is None for v in values):
        return "-"
    s = [f"{v / 2**20:.2f}" for v in values]
    return s[0] if len(set(s)) == 1 else "/".join(s)


def markdown(rows, cfg, n_params):
    psi = n_params
    hdr = (f"world size {cfg['world_size']} (gloo, FileStore, {cfg['threads']} thread/rank), "
           f"{cfg['steps']} steps (median over steps {cfg['warmup'] + 1}-{cfg['steps']}), model "
           f"{cfg['layers']}L d{cfg['d_model']} h{cfg['heads']} vocab {cfg['vocab']} seq "
           f"{cfg['seq']}{' tied head' if cfg['tie_head'] else ''}: Ψ = {psi:,} params "
           f"(4Ψ = {4 * psi / 2**20:.2f} MiB), micro-batch {cfg['batch']}/rank, AdamW lr "
           f"{cfg['lr']} wd {cfg['weight_decay']}, zerotrain buckets "
           f"{cfg['bucket_elems']:.0e} elements. Memory per rank (a/b when ranks differ), "
           f"after the last backward, before its optimizer step. Step times are wall clock, "
           f"per step the max over ranks; CPU s/step: process CPU time (all threads) per "
           f"step, max over ranks, median: less sensitive to co-tenant load. "
           f"Rounds: {cfg['rounds']} (each "
           f"row: its fastest round). Other load: cores busy with other processes of the "
           f"machine while the row ran (co-tenant contention; 0 = quiet).")
    cols = ["peer", "status", "median step (s)", "vs torch peer", "min step (s)",
            "CPU s/step", "fwd / bwd / opt (ms)",
            "params (MiB)", "grads (MiB)", "optim state (MiB)", "live tensors (MiB)",
            "peak RSS (MiB)", "final loss", "max \\|Δparam\\| vs DDP", "other load (cores)"]
    lines = [hdr, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        if r["status"] != "ok":
            err = r["error"].replace("|", "\\|")
            lines.append(f"| {r['peer']} | FAILED: {err} | " + " | ".join(["-"] * (len(cols) - 2))
                         + " |")
            continue
        ph = r["phase_median_s"]
        ratio = r.get("ratio_vs_torch")
        mem = r["memory"]
        lines.append(" | ".join([
            f"| {r['peer']}", "ok", f"{r['median_step_s']:.3f}",
            "-" if ratio is None else f"{ratio:.2f}× {r['torch_peer']}",
            f"{r['min_step_s']:.3f}", f"{r['median_cpu_s']:.3f}",
            f"{ph['forward'] * 1e3:.0f} / {ph['backward'] * 1e3:.0f} / "
            f"{ph['optimizer_step'] * 1e3:.0f}",
            _mib_per_rank([m.get("parameters") for m in mem]),
            _mib_per_rank([m.get("gradients") for m in mem]),
            _mib_per_rank([m.get("optimizer_state") for m in mem]),
            _mib_per_rank([m.get("live_tensors") for m in mem]),
            "/".join(str(round(v / 2**20)) for v in r["peak_rss"]),
            f"{r['final_loss']:.4f}",
            "-" if r.get("max_param_diff_vs_ddp") is None
            else f"{r['max_param_diff_vs_ddp']:.2e}",
            "-" if r.get("other_load_cores") is None else f"{r['other_load_cores']:.2f}",
        ]) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2, help="steps excluded from the median")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=None, help="default d_model // 64")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=4, help="micro-batch per rank")
    ap.add_argument("--tie-head", action="store_true", help="tie the head to the embedding")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--bucket-elems", type=float, default=5e6,
                    help="zerotrain reduce/allgather bucket size in elements")
    ap.add_argument("--peers", default=",".join(DEFAULT_PEERS),
                    help="comma list (see --list-peers)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per peer")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the peer list this many times (interleaved); each peer reports "
                         "its round with the lowest median step time (the least disturbed)")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--md-out", default=None)
    ap.add_argument("--keep-dir", default=None, help="keep per-peer files here")
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                    help="before each peer, wait up to this long for other processes to "
                         "leave the CPUs (see --quiet-cores); 0: do not wait")
    ap.add_argument("--quiet-cores", type=float, default=0.3,
                    help="'quiet' means other processes keep fewer cores than this busy")
    ap.add_argument("--no-snapshot", dest="snapshot", action="store_false",
                    help="import zerotrain from the working tree in every rank instead of a "
                         "copy taken at the start")
    ap.add_argument("--list-peers", action="store_true")
    a = ap.parse_args(argv)

    if a.list_peers:
        for name, (kind, opts) in PEERS.items():
            print(f"{name:16s} {kind:11s} {json.dumps(opts)}")
        return 0
    peers = [p.strip() for p in a.peers.split(",") if p.strip()]
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        ap.error(f"unknown peer(s) {unknown}; known: {', '.join(PEERS)}")
    heads = a.heads or max(1, a.d_model // 64)
    if a.d_model % heads:
        ap.error("--d-model must be divisible by --heads")
    cfg = dict(steps=a.steps, warmup=a.warmup, layers=a.layers, d_model=a.d_model, heads=heads,
               seq=a.seq, vocab=a.vocab, batch=a.batch, tie_head=a.tie_head, lr=a.lr,
               weight_decay=a.weight_decay, seed=a.seed, world_size=a.world_size,
               threads=a.threads, bucket_elems=a.bucket_elems, timeout=a.timeout, rounds=a.rounds,
               coll_timeout=max(60, int(a.timeout)))
    os.environ["OMP_NUM_THREADS"] = str(a.threads)  # inherited by the spawned ranks
    os.environ.setdefault("PYTHONWARNINGS", "ignore")

    base = a.keep_dir or tempfile.mkdtemp(prefix="peers_cpu_")
    os.makedirs(base, exist_ok=True)
    tree_root = zerotrain_root()
    snap = snapshot_zerotrain(base) if a.snapshot and tree_root else None
    digest_before = zerotrain_digest(snap or tree_root)
    runs: dict[str, list] = {p: [] for p in peers}
    for rnd in range(a.rounds):
        for peer in peers:
            print(f"[peers_cpu] round {rnd + 1}/{a.rounds} {peer} ...", file=sys.stderr,
                  flush=True)
            waited = wait_for_quiet(a.wait_quiet, a.quiet_cores)
            cpu0 = _cpu_snapshot()
            try:
                row = run_peer(peer, cfg, os.path.join(base, f"round{rnd}"))
            except Exception as e:  # noqa: BLE001
                row = {"peer": peer, "stage": stage_of(peer), "status": "FAILED",
                       "error": f"harness: {type(e).__name__}: {e}"}
            row["round"] = rnd
            row["waited_for_quiet_s"] = waited
            row["other_load_cores"] = _other_load(cpu0, _cpu_snapshot())
            runs[peer].append(row)
            msg = (f"median {row['median_step_s']:.3f}s loss {row['final_loss']:.4f}"
                   if row["status"] == "ok" else row["error"])
            print(f"[peers_cpu] {peer}: {row['status']} ({row.get('wall_s', '?')}s, other "
                  f"load {row['other_load_cores']} cores) {msg}", file=sys.stderr, flush=True)
    rows = []
    for peer in peers:  # per peer: the least disturbed round (lowest median step time)
        ok = [r for r in runs[peer] if r["status"] == "ok"]
        best = min(ok, key=lambda r: r["median_step_s"]) if ok else runs[peer][-1]
        best = dict(best)
        best["round_medians_s"] = [r.get("median_step_s") for r in runs[peer]]
        best["round_other_load_cores"] = [r.get("other_load_cores") for r in runs[peer]]
        rows.append(best)

    by_name = {r["peer"]: r for r in rows}
    ref = by_name.get(PARITY_PEER)
    ok_names = {r["peer"] for r in rows if r["status"] == "ok"}
    for r in rows:
        if r["status"] != "ok":
            continue
        r["torch_peer"] = torch_peer_for(r["peer"], ok_names)
        tp = by_name.get(r["torch_peer"])
        if r["kind"] == "zerotrain" and tp and tp["status"] == "ok":
            r["ratio_vs_torch"] = r["median_step_s"] / tp["median_step_s"]
        if ref and ref["status"] == "ok":
            try:
                r["max_param_diff_vs_ddp"] = param_diff(r["params_path"], ref["params_path"])
            except Exception as e:  # noqa: BLE001
                r["param_diff_error"] = f"{type(e).__name__}: {e}"
            r["max_loss_diff_vs_ddp"] = max(abs(x - y) for x, y in zip(r["losses"],
                                                                        ref["losses"]))

    import torch
    n_params = sum(p.numel() for p in build_model(cfg).parameters())
    md = markdown(rows, cfg, n_params)
    digest_after = zerotrain_digest(tree_root)
    machine = machine_line()
    machine += f"; zerotrain source sha256[:12] {digest_before}"
    if digest_after != digest_before:
        machine += (f" (the working tree is now {digest_after}; "
                    + ("every row ran the snapshot taken at the start)" if snap else
                       "WARNING: it changed during the run, rows may have measured different "
                       "code)"))
    print(md)
    print(machine)
    if a.md_out:
        with open(a.md_out, "w") as f:
            f.write(md + "\n" + machine + "\n")
    if a.json_out:
        for r in rows:
            r.pop("params_path", None)
        with open(a.json_out, "w") as f:
            json.dump({"config": cfg, "n_params": n_params, "machine": machine,
                       "zerotrain_digest": [digest_before, digest_after],
                       "torch": torch.__version__, "command": " ".join(sys.argv),
                       "rows": rows}, f, indent=1)
    if not a.keep_dir:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
