"""What a worker trains: a task builds the model and gives each rank its batches and the validation loss."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from netgain import data, models
from netgain.train.config import TrainConfig

VALIDATION_BATCHES = 16  # the fixed held-out set: 16 batches of 8 sequences (lm)
VALIDATION_BATCH_SIZE = 8
FP32_BYTES = 4
PARAMETER_COPIES = 4  # training holds weights, gradients and AdamW's two moments


class LanguageModelTask:
    """Next-byte prediction with a small Llama; validation loss in nats per byte."""

    SHAPE = ("hidden_size", "layers", "seq_len", "batch_size")  # the settings its memory grows with

    def __init__(self, config: TrainConfig):
        files = data.text_files(config.data) if config.data else data.stdlib_source_files()
        self.corpus = data.ByteCorpus.from_files(files)
        self.config = config
        self.validation = self.corpus.validation_batches(VALIDATION_BATCHES, VALIDATION_BATCH_SIZE,
                                                         config.seq_len)

    def build_model(self) -> nn.Module:
        return self.model_of(self.config)

    @staticmethod
    def model_of(c: TrainConfig) -> nn.Module:
        """The model these settings describe (on the meta device: its shapes, without allocating)."""
        return models.byte_llama(c.hidden_size, c.layers, c.seq_len)

    @staticmethod
    def parameter_count(c: TrainConfig) -> int:
        """byte_llama's parameters, counted from the settings: building 100,000 layers to count them takes minutes."""
        h, intermediate = c.hidden_size, models.mlp_size(c.hidden_size)
        key_value = max(1, h // models.HEAD_DIM // 2) * models.HEAD_DIM
        layer = 2 * h * h + 2 * h * key_value + 3 * h * intermediate + 2 * h
        return 2 * models.BYTE_VOCAB * h + h + c.layers * layer

    @classmethod
    def memory_bytes(cls, c: TrainConfig) -> int:
        """At least this much per worker, in fp32: the parameters' PARAMETER_COPIES (sharded under --fsdp),
        and for each of batch x seq-len tokens the activations backward keeps: per layer at least its
        input, normed input, query and attention output (4 x hidden) and the MLP's gate, up and product
        (3 x intermediate), and the logits and their gradient."""
        per_token = c.layers * (4 * c.hidden_size + 3 * models.mlp_size(c.hidden_size)) + 2 * models.BYTE_VOCAB
        return FP32_BYTES * (PARAMETER_COPIES * cls.parameter_count(c) // (c.shards or 1)
                             + c.batch_size * c.seq_len * per_token)

    @staticmethod
    def blocks(model: nn.Module) -> list[nn.Module]:
        """--fsdp: one FSDP group per decoder layer (the root holds embeddings, norm and head)."""
        return list(model.model.layers)

    def train_loss(self, model: nn.Module, step: int, rank: int, world_size: int,
                   device: torch.device) -> torch.Tensor:
        c = self.config
        ids = self.corpus.train_batch(c.seed, step, rank, world_size, c.batch_size, c.seq_len).to(device)
        return model(input_ids=ids, labels=ids).loss

    @torch.no_grad()
    def evaluate(self, model: nn.Module, rank: int, world_size: int, device: torch.device) -> dict:
        """Every rank runs as many forwards (an FSDP forward all-gathers): a rank short of a batch weighs one 0."""
        sums = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, batches
        mine = self.validation[rank::world_size]
        for i in range(-(-len(self.validation) // world_size)):
            ids = (mine[i] if i < len(mine) else self.validation[0]).to(device)
            weight = float(i < len(mine))
            sums += torch.tensor([weight * model(input_ids=ids, labels=ids).loss.item(), weight],
                                 dtype=torch.float64, device=device)
        dist.all_reduce(sums)
        return {"val_loss": (sums[0] / sums[1]).item()}


class DigitsTask:
    """Classify sklearn's 8x8 digits with an MLP: a convergence check that runs in seconds."""

    SHAPE = ("batch_size",)

    def __init__(self, config: TrainConfig):
        self.digits = data.Digits.load()
        self.config = config

    def build_model(self) -> nn.Module:
        return self.model_of(self.config)

    @staticmethod
    def model_of(c: TrainConfig) -> nn.Module:
        return models.digits_mlp()

    @staticmethod
    def memory_bytes(c: TrainConfig) -> int:
        """At least this much per worker: the MLP's parameters, and each example's input and layer outputs."""
        model = models.digits_mlp()
        per_example = sum(m.in_features + m.out_features for m in model if isinstance(m, nn.Linear))
        return FP32_BYTES * (PARAMETER_COPIES * models.parameter_count(model) + c.batch_size * per_example)

    @staticmethod
    def blocks(model: nn.Module) -> list[nn.Module]:
        """--fsdp: the MLP is one FSDP group (the root's)."""
        return []

    def train_loss(self, model: nn.Module, step: int, rank: int, world_size: int,
                   device: torch.device) -> torch.Tensor:
        c = self.config
        x, y = self.digits.train_batch(c.seed, step, rank, world_size, c.batch_size)
        return F.cross_entropy(model(x.to(device)), y.to(device))

    @torch.no_grad()
    def evaluate(self, model: nn.Module, rank: int, world_size: int, device: torch.device) -> dict:
        start, stop = data.shard(len(self.digits.test_y), rank, world_size)
        x, y = self.digits.test_x[start:stop].to(device), self.digits.test_y[start:stop].to(device)
        logits = model(x)
        sums = torch.tensor([F.cross_entropy(logits, y, reduction="sum").item(),
                             (logits.argmax(1) == y).sum().item(), len(y)],
                            dtype=torch.float64, device=device)
        dist.all_reduce(sums)
        return {"val_loss": (sums[0] / sums[2]).item(), "val_accuracy": (sums[1] / sums[2]).item()}


TASK_CLASSES = {"lm": LanguageModelTask, "digits": DigitsTask}
