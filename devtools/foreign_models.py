"""Models the project did not write for itself, for the tests of "any PyTorch model" (arceus.model.exported):
torchvision's ResNet-18 (its shape at a small width: torchvision's wheel for torch 2.13 is built against CUDA
torch) and a Hugging Face GPT-2 built from a config, no download."""

from __future__ import annotations

import torch
import transformers
from torch import nn


class BasicBlock(nn.Module):
    """torchvision.models.resnet.BasicBlock (torchvision's wheel for torch 2.13 is built against CUDA torch)."""

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class ResNet18(nn.Module):
    """torchvision's ResNet-18 ([2, 2, 2, 2] BasicBlocks, same stem and head) at `width` instead of 64."""

    def __init__(self, width: int = 8, classes: int = 10, in_channels: int = 3) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        planes, layers = width, []
        for i, mult in enumerate((1, 2, 4, 8)):
            stride = 1 if i == 0 else 2
            out = width * mult
            layers.append(nn.Sequential(BasicBlock(planes, out, stride), BasicBlock(out, out)))
            planes = width * mult
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(planes, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class GPT2Logits(nn.Module):
    """A Hugging Face GPT-2 built from a config (no download), returning its logits."""

    def __init__(self, vocab_size: int, *, tied: bool = False) -> None:
        """`tied`: its LM head is its token embedding (GPT-2's default)."""
        super().__init__()
        config = transformers.GPT2Config(
            vocab_size=vocab_size, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, tie_word_embeddings=tied, use_cache=False, bos_token_id=0, eos_token_id=0,
        )
        self.model = transformers.GPT2LMHeadModel(config)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids).logits
