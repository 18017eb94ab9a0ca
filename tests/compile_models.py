"""Small models the compile tests share: a googlenet-like inception block as a function and a module,
and that module compiled into regions."""

import torch

import streamdag as sd


def inception(x, w1, w2a, w2b, w3a, w3b, w4):
    """A googlenet-like inception block: four branches of one input, concatenated."""
    conv = torch.nn.functional.conv2d
    b1 = conv(x, w1).relu()
    b2 = conv(conv(x, w2a).relu(), w2b, padding=1).relu()
    b3 = conv(conv(x, w3a).relu(), w3b, padding=2).relu()
    b4 = conv(torch.nn.functional.max_pool2d(x, 3, 1, 1), w4).relu()
    return torch.cat([b1, b2, b3, b4], 1)


def inception_args(c=8, hw=8):
    g = torch.Generator().manual_seed(0)

    def r(*s):
        return torch.randn(*s, generator=g) / 4

    return [r(1, c, hw, hw), r(4, c, 1, 1), r(4, c, 1, 1), r(4, 4, 3, 3), r(2, c, 1, 1), r(4, 2, 5, 5),
            r(4, c, 1, 1)]


class Inception(torch.nn.Module):
    def __init__(self, c=8):
        super().__init__()
        conv = torch.nn.Conv2d
        self.b1 = conv(c, 4, 1)
        self.b2 = torch.nn.Sequential(conv(c, 4, 1), torch.nn.ReLU(), conv(4, 4, 3, padding=1))
        self.b3 = torch.nn.Sequential(conv(c, 2, 1), torch.nn.ReLU(), conv(2, 4, 5, padding=2))
        self.b4 = torch.nn.Sequential(torch.nn.MaxPool2d(3, 1, 1), conv(c, 4, 1))

    def forward(self, x):
        return torch.cat([self.b1(x), self.b2(x), self.b3(x), self.b4(x)], 1).relu()


def inception_in_regions():
    """An inception block compiled into regions alone, its first call equal to eager's: (the model,
    the compiled model, the input)."""
    torch.manual_seed(0)
    m = Inception().eval()
    c = sd.compile(m, regions="always", candidates=["regions"])
    x = torch.randn(2, 8, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(c(x), m(x))
    return m, c, x
