"""The model and data of train_ds.py, also imported by the DDP reference in the tests."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 17)
        self.fc2 = nn.Linear(17, 9)
        self.fc3 = nn.Linear(9, 3)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(torch.tanh(self.fc1(x)))))


def build_model():
    torch.manual_seed(1234)
    return Net()


def batch(step, rank, size=4):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(size, 6, generator=g), torch.randint(0, 3, (size,), generator=g)
