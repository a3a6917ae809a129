"""Small models the tests share."""

import torch
from torch import nn


class UnevenMLP(nn.Module):
    """7 and 5 rows divide by neither 2 nor 3 ranks (uneven and empty shards); the head has 1
    row, fewer than the ranks."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 7)
        self.hidden = nn.Linear(7, 5)
        self.head = nn.Linear(5, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.hidden(torch.relu(self.inp(x)))))
