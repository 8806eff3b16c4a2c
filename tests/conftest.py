import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch.set_num_threads(1)  # tiny test models run fastest (and least noisily) on one thread


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
