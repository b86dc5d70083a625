"""Training runs for tests/test_integrations.py, one client per launch:

    torchrun --standalone --nproc-per-node 2 tests/integrations_script.py lightning|accelerate|transformers OUT

Each rank writes OUT/<client>_<rank>.pt: plain tensors, numbers and strings (loaded weights_only).
"""

import os
import sys
import time

import torch

torch.set_num_threads(1)
from netgain.comm import CommConfig, GlobalQSGDConfig, KimadConfig, TopKConfig  # noqa: E402

GQSGD = GlobalQSGDConfig(bits=8)


def tiny_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))


def regression_data(n=128):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(n, 32, generator=generator)
    return x, torch.sin(x[:, :4].sum(1, keepdim=True))


def params(model):
    return [p.detach().clone() for p in model.parameters()]


def hook_steps(state):
    """Per hook step: (step, wire bytes, buckets, codecs used)."""
    return [{"step": h["step"], "wire_bytes": h["wire_bytes"], "raw_bytes": h["raw_bytes"], "buckets": h["buckets"]}
            for h in state.history]


# ---- Lightning --------------------------------------------------------------------------------
def lightning_runs(out):
    import lightning
    from lightning.pytorch.callbacks import ModelCheckpoint
    from netgain.integrations.lightning import NetgainDDP

    class Regression(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = tiny_model()

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x).float(), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    x, y = regression_data()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)

    def fit(config=None, epochs=2, ckpt_path=None, checkpoints=None, callback=None, **trainer_options):
        module = Regression()
        callbacks = [callback or NetgainDDP(config)] if config is not None else []
        if checkpoints:
            callbacks.append(ModelCheckpoint(dirpath=checkpoints, filename="{epoch}", save_top_k=-1))
        trainer = lightning.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=epochs,
                                    logger=False, enable_progress_bar=False, enable_model_summary=False,
                                    enable_checkpointing=bool(checkpoints), callbacks=callbacks, **trainer_options)
        trainer.fit(module, loader, ckpt_path=ckpt_path)
        with torch.no_grad():
            loss = torch.nn.functional.mse_loss(module.net(x), y).item()
        state = callbacks[0].state if config is not None else None
        return {"loss": loss, "params": params(module.net), "global_step": trainer.global_step,
                "hook": hook_steps(state) if state is not None else [],
                "codecs": [b["codec"] for b in state.last_step["per_bucket"]] if state is not None else [],
                "ef21_step": state.step if state is not None else None}

    results = {"none": fit(), "gqsgd": fit(GQSGD), "topk": fit(TopKConfig(ratio=0.1)),
               "kimad+": fit(KimadConfig(mode="kimad+")),
               "bf16_accumulate": fit(GQSGD, precision="bf16-mixed", accumulate_grad_batches=2)}
    for name, config in (("gqsgd", GQSGD), ("topk", TopKConfig(ratio=0.1))):
        folder = os.path.join(out, f"lightning_{name}")
        callback = NetgainDDP(config)  # one callback for both fits (topk: a fresh one resumes)
        fit(config, epochs=1, checkpoints=folder, callback=callback)
        results[f"resumed_{name}"] = fit(config, epochs=2, ckpt_path=os.path.join(folder, "epoch=0.ckpt"),
                                         callback=callback if name == "gqsgd" else None)
    return results


# ---- Accelerate -------------------------------------------------------------------------------
def plain_accelerator_on_cpu():
    """The README's plain Accelerator() under torchrun on a machine without GPUs: Accelerate runs each rank alone."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from netgain.integrations.accelerate import register

    try:
        accelerator = Accelerator()
        register(accelerator, accelerator.prepare(tiny_model()), "gqsgd")
        return "registered"
    except ValueError as error:
        return str(error)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)  # the next Accelerator(cpu=True) starts afresh


def accelerate_runs(out):
    from accelerate import Accelerator
    from netgain.integrations.accelerate import register

    plain = plain_accelerator_on_cpu()

    def train(steps, start=0, load=None, save=None, reload=False):
        accelerator = Accelerator(cpu=True)
        model = tiny_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        model, optimizer = accelerator.prepare(model, optimizer)
        state = register(accelerator, model, CommConfig(TopKConfig(ratio=0.1)))
        if load:
            accelerator.load_state(load)
        for step in range(start, start + steps):
            generator = torch.Generator().manual_seed(1000 * step + accelerator.process_index)
            x = torch.randn(8, 32, generator=generator)
            loss = torch.nn.functional.mse_loss(model(x), torch.sin(x[:, :4].sum(1, keepdim=True)))
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if save:
            accelerator.save_state(save)
        if reload:  # at once, no wait_for_everyone: save_state returns once rank 0 has written the file
            accelerator.load_state(save)
        state.close()
        return {"params": params(model), "hook": hook_steps(state), "ef21_step": state.step,
                "distributed_type": str(accelerator.distributed_type)}

    try:
        register(Accelerator(cpu=True), tiny_model(), "gqsgd")
        unprepared = ""
    except TypeError as error:
        unprepared = str(error)
    folder = os.path.join(out, "accelerate_ckpt")
    straight = train(6)
    first = train(3, save=folder)
    resumed = train(3, start=3, load=folder)
    write = torch.save

    def late_on_rank_zero(*args, **kwargs):  # rank 0 writes late: a rank that read at once found no or half a file
        if int(os.environ["RANK"]) == 0:
            time.sleep(1.0)
        return write(*args, **kwargs)

    torch.save = late_on_rank_zero
    try:
        reloaded = train(3, save=os.path.join(out, "accelerate_reload"), reload=True)
    finally:
        torch.save = write
    return {"straight": straight, "first": first, "resumed": resumed, "reloaded": reloaded, "unprepared": unprepared,
            "plain": plain}


# ---- Hugging Face Trainer ---------------------------------------------------------------------
def transformers_runs(out):
    import shutil

    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
    from netgain.integrations.transformers import register

    generator = torch.Generator().manual_seed(2)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 128, (32, 16), generator=generator)]
    folder = os.path.join(out, "hf")

    def train(resume=None, output=folder):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                             max_position_embeddings=64))
        args = TrainingArguments(output_dir=output, per_device_train_batch_size=4, max_steps=6, save_steps=3,
                                 learning_rate=1e-3, use_cpu=True, ddp_backend="gloo", report_to=[],
                                 disable_tqdm=True, logging_steps=100, seed=0)
        trainer = Trainer(model=model, args=args, train_dataset=data)
        callback = register(trainer, GQSGD)
        trainer.train(resume_from_checkpoint=resume)
        return {"params": params(model), "hook": hook_steps(callback.state), "ef21_step": callback.state.step}

    straight = train()
    saved = torch.load(os.path.join(folder, "checkpoint-3", "netgain_comm.pt"), weights_only=True)
    resumed = train(resume=os.path.join(folder, "checkpoint-3"))
    moved, bare = os.path.join(out, "moved", "checkpoint"), os.path.join(out, "bare", "checkpoint")
    if dist.get_rank() == 0:  # the checkpoint somewhere else, and a copy without the codec state
        shutil.copytree(os.path.join(folder, "checkpoint-3"), moved)
        shutil.copytree(moved, bare)
        os.remove(os.path.join(bare, "netgain_comm.pt"))
    dist.barrier()
    elsewhere = train(resume=moved, output=os.path.join(out, "hf_elsewhere"))
    try:
        train(resume=bare, output=os.path.join(out, "hf_bare"))
        missing = ""
    except FileNotFoundError as error:
        missing = str(error)
    return {"straight": straight, "resumed": resumed, "elsewhere": elsewhere, "missing": missing,
            "saved_step": saved["step"]}


if __name__ == "__main__":
    client, out = sys.argv[1], sys.argv[2]
    results = {"lightning": lightning_runs, "accelerate": accelerate_runs, "transformers": transformers_runs}[client](out)
    import torch.distributed as dist
    torch.save(results, os.path.join(out, f"{client}_{dist.get_rank()}.pt"))
    dist.barrier()
    dist.destroy_process_group()
