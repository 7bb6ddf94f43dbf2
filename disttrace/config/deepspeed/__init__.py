"""Read a DeepSpeed config (JSON) into a manifest: `disttrace freeze --from-deepspeed ds_config.json`.

The config is laid over a base manifest (default manifests/default.toml), which supplies what a DeepSpeed
config does not hold: the experiment, data, tokenizer, model, steps, seed. What DeepSpeed does hold is
mapped where the manifest has a field for it, refused where running without it would compute something else
than DeepSpeed would (fp16/bf16), and otherwise *named* in the returned list: nothing is dropped silently.

The batch identity is checked exactly as DeepSpeed checks it (``DeepSpeedConfig._set_batch_related_parameters``
then ``_batch_assertion`` in deepspeed/runtime/config.py), with DeepSpeed's own wording, so the message a user
gets here is the one DeepSpeed would have stopped with on the cluster. DeepSpeed's ``world_size`` there is
the data-parallel size (``mpu.get_data_parallel_world_size()``; the whole world when there is no model
parallelism), i.e. ``parallelism.dp``.

One module a concern: `batch` (DeepSpeed's batch rules), `values` (the JSON and its values, what each
unmapped key is), `sections` and `optimizer` (the mapping), `build` (the manifest, and its freezing).
"""

from disttrace.config.deepspeed.batch import BatchAssertion, identity_message, resolve_batch
from disttrace.config.deepspeed.build import freeze_from_deepspeed, manifest_from_deepspeed
from disttrace.config.deepspeed.values import read_ds_config

__all__ = [
    "BatchAssertion",
    "freeze_from_deepspeed",
    "identity_message",
    "manifest_from_deepspeed",
    "read_ds_config",
    "resolve_batch",
]
