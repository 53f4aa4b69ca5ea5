"""GRPO and SFT on a LoRA adapter: the learning core the worker drives.

A library: it never imports the control plane (api, db, scheduler, storage) or the worker, and
runs alone on CPU (fp32) or CUDA (bf16; Unsloth when importable). Public API::

    from skytrain_backend.trainer import Trainer

    trainer = Trainer.load(base_model, model_config=ModelConfig(...),
                           adapter_dir=None,   # or a checkpoint directory written by save()
                           device=None)        # None: cuda if available, else cpu
    plan = trainer.prepare_rl(groups, RLTrainConfig(...))  # data work now (TrainingError)
    plan.num_gradient_steps  # known before the first step
    plan.summary             # {"groups/skipped_zero_variance", "tokens/trainable",
                             #  "logprob_agreement/mean_abs_diff", "packing/...", ...}
    plan.warning             # None, or why the sampler's logprobs are far from the trainer's
    plan.agreement_pending   # True until the first step's forward pass has read the old
                             # logprobs: logprob_agreement/* and warning are known then
    for metrics in trainer.run(plan):  # one optimizer step per iteration
        ...                  # {"loss/policy", "loss/kl", "clip_ratio/low", "clip_ratio/high",
                             #  "ratio/mean", "entropy", "grad_norm", ...}
    trainer.save(directory)  # adapter_config.json, adapter_model.safetensors (peft: vLLM and
                             # peft load it), optimizer.pt, trainer_state.json {"step", ...}
    trainer.release()        # frees its memory, the GPU's too (a worker's engine wakes next)
    trainer.events           # [{"event": "loaded" | "gradient_step" | "saved" | "released",
                             #   "at": unix time, ...}]
    plan = trainer.prepare_sft(trajectories, SFTTrainConfig(...))

    # A job stopped between two steps (a worker yielding to another tenant's job):
    trainer.save_progress(plan, directory)   # a checkpoint at the job's base step + progress.pt
    trainer = Trainer.load(base_model, model_config=..., adapter_dir=directory)  # any worker
    plan = trainer.prepare_rl(groups, config, resume_from=directory)  # or prepare_sft(...)
    plan.steps_done, plan.step_metrics       # where it stopped; every step's metrics so far
    for metrics in trainer.run(plan): ...    # the steps left: the same adapter at the end

- ``base_model`` goes through ``hub.resolve_model`` (local directory, skytrain's cache, or a
  Hugging Face id). Without ``adapter_dir`` the adapter is fresh and seeded: its B matrices are
  zero, so it computes exactly the base model (step 0). With a checkpoint directory the adapter
  weights, the optimizer state and the step are restored, so a resumed run continues exactly.
- Out of memory (loading, a step, saving) is ``errors.OutOfMemory``: ``memory`` refuses a row
  whose estimated activations exceed ``activation_memory_limit_bytes`` (``Trainer.load``; on
  CUDA, by default, the memory free then) before its forward pass, and turns CUDA's own error
  into the same one after freeing what the step held.
- A job can stop at any step boundary and resume on another worker with exactly the result
  of a run that never stopped (bitwise on CPU): ``progress`` says what the saved state holds.
- ``trainer.step`` is the checkpoint step the adapter is at; it advances by one when a plan has
  been run to its end (even a plan with no steps, when every group had zero reward variance).
- The old logprobs (the policy's before any update: where the sampler gave none, and for the
  sampler-vs-trainer agreement) of the first step's rows come from that step's own forward
  pass, which precedes its update; the later steps' rows are read in a pass without gradient
  in ``prepare_rl``, as all rows are when the policy drops out or with ``separate_pass=True``.
- A job is ``num_gradient_steps`` optimizer steps over whole groups (one by default), or one
  per row as ART fills rows (``"per_row"``), whatever the packing (``Trainer.load(packing=...)``:
  shared prefixes, packed, or one sequence per row as with Unsloth).
- Advantages are per group (``advantages``); each sampled turn is trained on the sampler's own
  prompt ids and sampled ids (``tokenize``); rows share each group's prompt (``packing``); the
  loss is PPO-clipped or CISPO with ART's importance sampling levels and options, a token mean
  or ART's aggregation, and an optional KL penalty against the base model, skytrain's or
  ART's (``loss``; docs/art.md).

Modules: ``advantages``, ``tokenize``, ``packing``, ``art_layout``, ``loss`` (pure functions),
``model`` (loading and the forward pass), ``memory`` (activation estimates, out of memory),
``plans`` (a job's steps before they run), ``trainer`` (the one ``Trainer`` class: the policy,
its optimizer and step, loading, saving, the optimizer step and the loop), ``rl`` and ``sft``
(each job kind as functions over a ``Trainer``: ``prepare``, ``pending_steps``,
``train_step``; they name it by ``state.TrainerState``, a Protocol), ``rl_rows`` (an RL batch as steps and rows), ``progress`` (a job's state
between two steps), ``primitives`` (Tinker's calls over a ``Trainer``), ``distributed`` (one
trainer as several torchrun processes, the base sharded with FSDP2:
``Trainer.load(shards=Shards.from_environment())``) and ``job`` (the entry point those
processes run). No mixins: ``tests/trainer/test_structure.py`` fails on a class with more than
one base from the project.
"""

from skytrain_backend.trainer.trainer import RLPlan, SFTPlan, Trainer

__all__ = ["RLPlan", "SFTPlan", "Trainer"]
