"""LoRAPP (mLoRA, Ye et al., VLDB 2025, Sec. 3.2): the frozen base split into P pipeline stages on P processes; the micro-batches
of different jobs fill the pipeline with no flush between jobs.

* Stage s holds decoder layers ``[lo_s, hi_s)`` (embeddings on stage 0, final norm + LM head on the last) and the
  LoRA factors, optimizers and schedules of every job for the modules of those layers. It never holds the rest of
  the base: :func:`load_stage_model` builds the model on the meta device and reads only the stage's tensors from the
  checkpoint's safetensors files (sharded or not, tied head included) straight onto its device in the run's dtype,
  so a stage's weights are about 1/P of the model (recorded per stage in the results: ``load_per_stage``).
* Each job's optimizer step is packed into single-job micro-batches (token budget, first-fit decreasing); the
  stream interleaves the jobs round-robin. A job's next-step micro-batch may enter a stage only after that
  stage has applied the job's previous step; other jobs' micro-batches keep the stages busy meanwhile, so with
  L >= P jobs the pipeline needs no flush (bubble max((P-L)/P, 0) in the paper's model).
* The schedule is simulated identically on every rank (unit-time slots): the first stage prefers forward, the
  others (the last included) prefer backward; at most P - s micro-batches are in flight on stage s (1F1B memory
  bound); forward order on a stage follows the previous stage's, backward order the next stage's, so the
  point-to-point messages match in order (NCCL-safe) and by tag (gloo).
* Grad-norm clipping needs the job's norm over all stages: backward messages carry the downstream sum of squared
  norms; stage 0 completes it and sends it with the job's next forward, where every stage applies the pending
  step before running that forward (no extra synchronization); the last steps are applied after one broadcast.
* Segments: the run streams each active job's steps up to its next evaluation point (the next multiple of its
  ``eval_every``, its last step, or its warm-up step: where the single-process engine evaluates), then drains the
  pipeline (the broadcast above). At that boundary, identical on every rank, the last stage's train and validation
  losses are broadcast and the engine's own code decides (:class:`StageEngine`; :meth:`Engine.after_step`: ALTO early
  exit, best-validation factors, warm-up parking and top-k selection; :meth:`Engine.admit`: the queue backfills freed
  slots under ``max_active_jobs`` and the memory model, predicted per stage with the stage's modules, the worst stage
  deciding; its analytic base term counts the stage's own weights, its activation term every layer, so it is
  conservative); finished jobs' factors are gathered to rank 0 and written. ``save_every`` / ``max_rounds`` /
  ``resume`` act at boundaries: each stage writes ``pipeline_state/stage{s}.seg{n}.pt`` (its layers' factors,
  AdamW / LR-schedule states, samplers, early-exit states), rank 0 ``pipeline_state/run_state.pt`` (statuses,
  histories, segment counter); a resumed run ends with the same adapters and losses as an uninterrupted one.
  Differences from the single-process engine: a non-finite train loss is acted on at the next boundary (not at
  once); LoRA-dropout masks are seeded per pipeline micro-batch, so dropout jobs are reproducible (and resume
  exactly) but do not equal the single-process run; the memory model is refitted from each stage's measured peak
  per segment (GPU), not per step.

Activations and gradients travel with ``torch.distributed`` send/recv (gloo on CPU, NCCL on GPU), each direction
on its own process group (:func:`p2p_groups`). :func:`init_distributed` starts a process group bound to this process's
GPU (``device_id``) for launchers that run the pipeline.
"""

from ..model import stage_bounds
from .run import PipelineRun, StageEngine, run_pipeline_distributed
from .schedule import PMB, simulate_schedule, theory_bubble
from .stage import Stage, init_distributed, p2p_groups

__all__ = ["PMB", "PipelineRun", "Stage", "StageEngine", "init_distributed", "p2p_groups", "run_pipeline_distributed",
           "simulate_schedule", "stage_bounds", "theory_bubble"]
