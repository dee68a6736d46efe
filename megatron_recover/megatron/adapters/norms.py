"""The layer norm of our local layer spec: LayerNorm or RMSNorm with what megatron-core's
`WrappedTorchNorm` refuses without Apex or Transformer Engine.

- Zero-centred gamma (Megatron-LM's --apply-layernorm-1p): the weight is stored as gamma - 1,
  starts at zero, and the norm applies (1 + weight), as Apex's and Transformer Engine's norms do.
  Weight decay then pulls gamma towards 1 instead of 0.
- Sequence parallelism: the weight and bias carry `sequence_parallel`, so megatron-core's
  `finalize_model_grads` sums their gradients over the tensor-parallel group (each rank saw
  only its slice of the sequence).

Otherwise it is `torch.nn.LayerNorm` / `torch.nn.RMSNorm`: the same kernels
(`F.layer_norm`, `F.rms_norm`), the same parameter names and initial values.
"""

import torch
import torch.nn.functional as F


class Norm(torch.nn.Module):
    """Built by megatron-core's `build_module` with the arguments it passes to a layer norm."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5,
                 persist_layer_norm: bool = False, zero_centered_gamma: bool = False,
                 normalization: str = "LayerNorm"):
        super().__init__()
        if config.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"normalization {config.normalization!r}: LayerNorm or RMSNorm")
        self.shape = (hidden_size,)
        self.eps = eps
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        start = torch.zeros if self.zero_centered_gamma else torch.ones
        # Where megatron-core's own layers put their parameters (nothing moves the model later).
        device = (torch.cuda.current_device()
                  if torch.cuda.is_available() and not config.use_cpu_initialization else None)
        kind = dict(dtype=config.params_dtype, device=device)
        self.weight = torch.nn.Parameter(start(hidden_size, **kind))
        self.bias = (None if config.normalization == "RMSNorm" else
                     torch.nn.Parameter(torch.zeros(hidden_size, **kind)))
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight + 1 if self.zero_centered_gamma else self.weight
        if self.bias is None:
            return F.rms_norm(x, self.shape, weight, self.eps)
        return F.layer_norm(x, self.shape, weight, self.bias, self.eps)
