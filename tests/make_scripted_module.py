"""Writes a TorchScript module that calls torch.ops.fsdp_ema.update_, for the C++ tests to load.

The module holds an EMA buffer and a weight parameter; forward(decay) updates the EMA through the
op (tensor and float decay overloads, both in the scripted graph).
"""

import argparse
import warnings

import torch


class EmaModule(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.arange(6, dtype=torch.float32).reshape(2, 3))
        self.register_buffer("ema", torch.zeros(2, 3))

    def forward(self, decay: torch.Tensor, decay_f: float) -> torch.Tensor:
        torch.ops.fsdp_ema.update_([self.ema], [self.weight.detach()], decay)
        torch.ops.fsdp_ema.update_([self.ema], [self.weight.detach()], decay_f)
        return self.ema


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--library", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.ops.load_library(args.library)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.jit.* is deprecated",
                                category=FutureWarning)
        scripted = torch.jit.script(EmaModule())
        assert "fsdp_ema::update_" in str(scripted.forward.graph)
        scripted.save(args.out)


if __name__ == "__main__":
    main()
