import sys, torch
from torch.profiler import profile, ProfilerActivity
from logitless.bench.cases import make_inputs, parse_shape
from logitless.bench.competitors import rows_of
from logitless.bench.batches import group_inputs, is_group_objective
obj, shape, name = sys.argv[1], sys.argv[2], sys.argv[3]
case = parse_shape(shape); dev = torch.device("cuda")
x = make_inputs(case, dev, torch.bfloat16)
if is_group_objective(obj): x = group_inputs(x, obj)
row = next(r for r in rows_of(obj) if r.name == name)
p = row.prepare(x, "auto")
def reset(): x.hidden.grad = x.weight.grad = None
for _ in range(3): reset(); p.step()
torch.cuda.synchronize(); reset(); torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU]) as prof:
    p.step(); torch.cuda.synchronize()
ev = sorted(prof.events(), key=lambda e: e.time_range.start)
t0 = ev[0].time_range.start
for e in ev:
    d = e.time_range.elapsed_us()
    if d > 60 and (e.name.startswith("cu") or e.name.startswith("aten::") and d > 150):
        print(f"{(e.time_range.start-t0)/1e3:8.3f} {d/1e3:7.3f} ms {e.name[:80]}")
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=40))
