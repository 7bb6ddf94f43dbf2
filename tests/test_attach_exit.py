"""An attached script's exit (docs/limits.md). A closed run holds nothing of the user's job alive, and
the seal's gather leaves no tensor for the process group's own thread to free later: that free, landing
while the interpreter finalized, aborted scripts ("terminate called without an active exception")."""

from __future__ import annotations

from conftest import run_snippet

PROLOGUE = """
import gc, os, weakref
import torch, torch.distributed as dist
import torch._dynamo  # what DDP's constructor imports; once imported after init it pins the world group (torch's)
from torch.nn.parallel import DistributedDataParallel as DDP
import disttrace.api
dist.init_process_group("gloo", init_method="file://{tmp}/store", rank=0, world_size=1)

def gloo_threads():
    if not os.path.isdir("/proc/self/task"):
        return None
    names = [open(f"/proc/self/task/{{t}}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    return sum(n.startswith("pt_gloo") for n in names)
"""


def test_a_closed_run_keeps_neither_the_model_nor_the_process_group(tmp_path):
    """DDP holds its comm hook in C++, out of the collector's sight: a hook holding the run made DDP -> hook ->
    run -> DDP a cycle no collection frees, so the model, DDP's reducer and the group (gloo's threads) lived
    until the process exited, whatever the script destroyed."""
    code = (
        PROLOGUE.format(tmp=tmp_path)
        + f"""
def train():
    ddp = DDP(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=4)
    run = disttrace.api.attach(ddp, opt, out={str(tmp_path)!r}, loader=loader, forward=True)
    for x in loader:
        opt.zero_grad()
        run.loss(ddp(x).square().mean()).backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        opt.step()
    run.close()
    assert (run.run_dir / "COMPLETE").exists()
    return weakref.ref(run), weakref.ref(ddp), weakref.ref(ddp.process_group)

refs = train()
running = gloo_threads()
dist.destroy_process_group()
gc.collect()
print("alive", [r() is not None for r in refs])
print("threads", running, gloo_threads())
"""
    )
    proc = run_snippet(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(
        line.split(" ", 1)
        for line in proc.stdout.splitlines()
        if line.startswith(("alive", "threads"))
    )
    assert lines["alive"] == "[False, False, False]", proc.stdout  # the run, DDP, the process group
    before, after = lines["threads"].split()
    if before != "None":
        assert int(before) > 0 and int(after) == 0, (
            proc.stdout
        )  # the group's threads joined at destroy


def test_the_seal_gather_leaves_no_tensor_to_the_backend_thread(tmp_path):
    """Every tensor the seal's gather hands to a collective is freed by the time it returns (gloo's worker
    still held one at the caller's return in 30 of 500 gathers measured without the wait); its result is
    torch's all_gather_object's."""
    code = (
        PROLOGUE.format(tmp=tmp_path)
        + """
from disttrace.run.job.complete import gather_released

class Watching:
    def __init__(self):
        self.refs = []
    def all_gather(self, outs, t):
        self.refs += [weakref.ref(x) for x in (*outs, t)]
        return dist.all_gather(outs, t)
    def __getattr__(self, name):
        return getattr(dist, name)

left = 0
for i in range(300):
    w = Watching()
    obj = {"rank": 0, "i": i, "blob": "x" * (i * 7)}
    ours, theirs = [None], [None]
    gather_released(w, ours, obj)
    left += sum(r() is not None for r in w.refs)
    assert len(w.refs) == 4, len(w.refs)  # two gathers (sizes, then the bytes), each its output and input
    dist.all_gather_object(theirs, obj)
    assert ours == theirs == [obj], (ours, theirs)
print("left", left)
dist.destroy_process_group()
"""
    )
    proc = run_snippet(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "left 0" in proc.stdout.splitlines(), proc.stdout
