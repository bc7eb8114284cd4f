"""torchvision's ``FrozenBatchNorm2d``, its output written over its input outside autograd.

``x * scale + shift`` becomes ``x.mul_(scale).add_(shift)`` (a float32 activation): the same two
roundings (to the bit), without two temporaries the size of the activation (on a CPU each large
one is a fresh mapping of memory, paged in as it is written). Only for models whose norms each
read a convolution's fresh output, nothing else reading it: torchvision's ResNets (``conv`` then
``bn``, and ``downsample``'s convolution then norm), the backbone of AMI's detector.
"""

from __future__ import annotations

import torch
from torchvision.ops.misc import FrozenBatchNorm2d


class InPlaceFrozenBatchNorm2d(FrozenBatchNorm2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (torch.is_grad_enabled() and x.requires_grad) or x.dtype != torch.float32:
            # Autograd needs its input; a half or bfloat16 activation is promoted to float32
            # by torchvision's norm (its scale is float32), which in place would round twice.
            return super().forward(x)
        w = self.weight.reshape(1, -1, 1, 1)
        b = self.bias.reshape(1, -1, 1, 1)
        rv = self.running_var.reshape(1, -1, 1, 1)
        rm = self.running_mean.reshape(1, -1, 1, 1)
        scale = w * (rv + self.eps).rsqrt()  # torchvision's arithmetic, in its order
        shift = b - rm * scale
        return x.mul_(scale).add_(shift)
