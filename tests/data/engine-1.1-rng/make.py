"""Written with zeroshard at commit af0cf96 (before rank-state blobs): a 2-rank stage-2 engine
checkpoint with an LR scheduler, and what each rank's RNGs draw right after the save."""
import json, os, random, sys
import numpy as np, torch, torch.distributed as dist
import zeroshard

out = sys.argv[1]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
engine = zeroshard.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                              config={"zero_optimization": {"stage": 2}})
sched = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=1, gamma=0.5)
rank = dist.get_rank()
for step in range(2):
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step * 10 + rank))
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    sched.step()
torch.manual_seed(100 + rank); random.seed(200 + rank); np.random.seed(300 + rank)
engine.save_checkpoint(out, tag="step-2", client_state={"next_step": 2}, lr_scheduler=sched)
draws = {"torch": torch.rand(3).tolist(), "python": [random.random() for _ in range(3)],
         "numpy": np.random.rand(3).tolist(), "lr": sched.get_last_lr(), "scheduler": sched.state_dict(),
         "full": {k: v.tolist() for k, v in engine.full_state_dict().items()}}
with open(os.path.join(out, f"expected-rank{rank}.json"), "w") as f:
    json.dump(draws, f)
dist.barrier()
