"""The optimizer step alone on one CUDA GPU: AdamW (fused) against Muon (Newton-Schulz in bfloat16 on each whole
block matrix, AdamW on the rest), over the parameters of an 8B-shaped model of N blocks (fp32 master weights, random
gradients), timed with CUDA events after warm-up. Prints a table; JSON to argv[1] when given.
    python scripts/gpu_checks/optimizer_step.py [out.json] [flavor]"""

import json
import sys

import torch

from trainer.config import JobConfig
from trainer.models.config import get_model_args
from trainer.models.llama.model import Transformer
from trainer.optim.optimizer import build_optimizer


def main() -> None:
    flavor = sys.argv[2] if len(sys.argv) > 2 else "llama3_8b_4l"
    torch.manual_seed(0)
    with torch.device("cuda"):
        args = get_model_args("llama3", flavor)
        if args.vocab_size <= 0:
            args.vocab_size = 128256  # Llama 3's tokenizer
        model = Transformer(args)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    rows = []
    for name in ("AdamW", "Muon"):
        cfg = JobConfig().optimizer
        cfg.name = name
        opt = build_optimizer(list(model.named_parameters()), cfg)
        for _ in range(3):
            opt.step()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            opt.step()
        end.record()
        torch.cuda.synchronize()
        rows.append({"optimizer": name, "step_ms": start.elapsed_time(end) / 10,
                     "params": sum(p.numel() for p in model.parameters())})
        del opt
        torch.cuda.empty_cache()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flavor)
    print(f"{'optimizer':>10} {'step ms':>10}")
    for r in rows:
        print(f"{r['optimizer']:>10} {r['step_ms']:>10.1f}")
    print(f"Muon / AdamW: {rows[1]['step_ms'] / rows[0]['step_ms']:.2f}")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "flavor": flavor,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
