"""netgain.integrations under the real clients: Lightning, Accelerate and the HF Trainer, 2 gloo ranks each.

Each client trains in one `torchrun --standalone --nproc-per-node 2 tests/integrations_script.py` launch
(module-scoped), and the tests check what its ranks wrote.
"""

import os
import subprocess
import sys

import pytest
import torch

SCRIPT = os.path.join(os.path.dirname(__file__), "integrations_script.py")


def launch(client, folder):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           SCRIPT, client, str(folder)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return [torch.load(folder / f"{client}_{rank}.pt", weights_only=True) for rank in range(2)]


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def ran_every_step(run, steps, compressed=True):
    """The hook's statistics: one entry per optimizer step, each with bytes on the wire; fewer than raw overall
    where the codec is fixed (an adaptive plan may send fp32 where the link is free: loopback)."""
    assert [h["step"] for h in run["hook"]] == list(range(steps))
    assert all(h["buckets"] >= 1 and h["wire_bytes"] > 0 for h in run["hook"]), run["hook"]
    assert not compressed or sum(h["wire_bytes"] for h in run["hook"]) < sum(h["raw_bytes"] for h in run["hook"])


# ---- Lightning --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lightning_ranks(tmp_path_factory):
    pytest.importorskip("lightning")
    return launch("lightning", tmp_path_factory.mktemp("lightning"))


@pytest.mark.parametrize("codec", ["gqsgd", "topk", "kimad+"])
def test_lightning_hook_runs_every_step_on_cpu(lightning_ranks, codec):
    for run in (rank[codec] for rank in lightning_ranks):
        assert run["global_step"] == 16  # 2 epochs of 64 samples per rank, batch 8
        ran_every_step(run, 16, compressed=not codec.startswith("kimad"))
    assert same(lightning_ranks[0][codec]["params"], lightning_ranks[1][codec]["params"])
    assert all(c.startswith(codec.rstrip("+")) or codec.startswith("kimad") for c in lightning_ranks[0][codec]["codecs"])


def test_lightning_gqsgd_loss_within_5_percent_of_no_hook(lightning_ranks):
    plain, gqsgd = lightning_ranks[0]["none"]["loss"], lightning_ranks[0]["gqsgd"]["loss"]
    assert abs(gqsgd - plain) <= 0.05 * plain, (plain, gqsgd)
    assert lightning_ranks[0]["none"]["hook"] == []


@pytest.mark.parametrize("codec", ["gqsgd", "topk"])
def test_lightning_fit_ckpt_path_resumes_bit_for_bit(lightning_ranks, codec):
    for rank in lightning_ranks:
        resumed, straight = rank[f"resumed_{codec}"], rank[codec]
        assert resumed["ef21_step"] == straight["ef21_step"] == 16
        assert [h["step"] for h in resumed["hook"]] == list(range(8, 16))  # the codec state came back at step 8
        assert same(resumed["params"], straight["params"])


def test_lightning_bf16_mixed_and_gradient_accumulation(lightning_ranks):
    for rank in lightning_ranks:
        run = rank["bf16_accumulate"]
        assert run["global_step"] == 8  # 16 batches, accumulate 2
        ran_every_step(run, 8)  # no_sync micro-batches send nothing
        assert run["loss"] < 1.5 * rank["none"]["loss"] + 0.1


def test_lightning_single_device_is_a_clear_error():
    lightning = pytest.importorskip("lightning")
    from netgain.integrations.lightning import NetgainDDP
    callback = NetgainDDP("gqsgd", bits=8)
    trainer = lightning.Trainer(accelerator="cpu", devices=1, callbacks=[callback], logger=False,
                                enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    with pytest.raises(TypeError, match="strategy='ddp'"):
        callback.on_fit_start(trainer, None)


def test_config_errors_name_the_argument():
    pytest.importorskip("lightning")
    from netgain.integrations.lightning import NetgainDDP
    with pytest.raises(ValueError, match="bits"):
        NetgainDDP("gqsgd", bits=12)


# ---- Accelerate -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def accelerate_ranks(tmp_path_factory):
    pytest.importorskip("accelerate")
    return launch("accelerate", tmp_path_factory.mktemp("accelerate"))


def test_accelerate_trains_and_load_state_resumes_bit_for_bit(accelerate_ranks):
    for rank in accelerate_ranks:
        assert rank["straight"]["distributed_type"].endswith("MULTI_CPU")
        ran_every_step(rank["straight"], 6)
        assert rank["resumed"]["ef21_step"] == 6
        assert [h["step"] for h in rank["resumed"]["hook"]] == [3, 4, 5]
        assert same(rank["resumed"]["params"], rank["straight"]["params"])
        assert not same(rank["first"]["params"], rank["straight"]["params"])
        assert "accelerator.prepare(model)" in rank["unprepared"], rank["unprepared"]


def test_accelerate_load_state_right_after_save_state_reads_the_whole_file(accelerate_ranks):
    """save_state waits until rank 0 has written netgain_comm.pt (rank 0 writes a second late here)."""
    for rank in accelerate_ranks:
        assert rank["reloaded"]["ef21_step"] == 3
        assert same(rank["reloaded"]["params"], rank["first"]["params"])


def test_a_plain_accelerator_on_a_cpu_machine_names_cpu_true(accelerate_ranks):
    """Accelerate 1.16 runs each torchrun rank alone on CPU unless told: the error says how, not the launch used."""
    for rank in accelerate_ranks:
        assert "one of WORLD_SIZE=2 launched ranks, but Accelerate runs it alone" in rank["plain"], rank["plain"]
        assert "Accelerator(cpu=True), or ACCELERATE_USE_CPU=1" in rank["plain"]


def test_accelerate_single_process_names_the_distributed_launch():
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from netgain.integrations.accelerate import register
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="torchrun --nproc-per-node 2"):
        register(accelerator, model, "gqsgd")


# ---- Hugging Face Trainer ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def transformers_ranks(tmp_path_factory):
    pytest.importorskip("transformers")
    return launch("transformers", tmp_path_factory.mktemp("transformers"))


def test_hf_trainer_single_process_is_a_clear_error(tmp_path):
    transformers = pytest.importorskip("transformers")
    from netgain.integrations.transformers import register
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=32))
    trainer = transformers.Trainer(model=model, args=transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[]))
    callback = register(trainer, "topk", ratio=0.1)
    with pytest.raises(TypeError, match="torchrun --nproc-per-node 2"):
        callback.on_train_begin(trainer.args, trainer.state, trainer.control)


def test_hf_trainer_hook_runs_and_resume_continues_the_codec_state(transformers_ranks):
    for rank in transformers_ranks:
        ran_every_step(rank["straight"], 6)
        assert rank["saved_step"] == 3
        assert [h["step"] for h in rank["resumed"]["hook"]] == [3, 4, 5]
        assert rank["resumed"]["ef21_step"] == 6
        assert same(rank["resumed"]["params"], rank["straight"]["params"])


def test_hf_trainer_resumes_from_a_checkpoint_outside_output_dir(transformers_ranks):
    """train(resume_from_checkpoint=<a copy elsewhere>) with another output_dir: the callback reads the state where
    the Trainer was told to resume; a checkpoint without the state is named."""
    for rank in transformers_ranks:
        assert [h["step"] for h in rank["elsewhere"]["hook"]] == [3, 4, 5]
        assert same(rank["elsewhere"]["params"], rank["straight"]["params"])
        assert "bare/checkpoint at step 3, but it holds no netgain_comm.pt" in rank["missing"], rank["missing"]


def test_clients_are_imported_only_by_their_integration_module():
    code = ("import sys, netgain, netgain.comm, netgain.integrations\n"
            "print(sorted(m for m in ('lightning', 'accelerate', 'pytorch_lightning') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr
