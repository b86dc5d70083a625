"""The netgain DDP hook where users train: Lightning, Accelerate, the Hugging Face Trainer.

Each client's own comm-hook option is a no-op for netgain (Lightning registers hooks only on
CUDA, Accelerate only its own enum hooks, the HF Trainer has none), so each module here
registers `netgain.comm.register` after the client's DDP wrap and carries the codec state
(EF21 buffers of every rank, collective `state_dict`) through the client's own checkpoints.

    from netgain.integrations.lightning import NetgainDDP            # pip install netgain[lightning]
    from netgain.integrations.accelerate import register             # pip install netgain[accelerate]
    from netgain.integrations.transformers import NetgainCallback    # pip install netgain[transformers]

Nothing is imported here: each module imports only its own client.
"""
