"""`flowrl.llm.trl`: a flowrl objective inside trl's `GRPOTrainer` reproduces trl 1.16's own losses.

Every parity case calls trl's own `GRPOTrainer._compute_loss` and `FlowrlGRPOTrainer._compute_loss` on two
identical tiny Llama models and the same crafted micro-batch (behaviour log-probs perturbed so that ratios leave
the trust region on both sides), and compares the loss and the gradient of every parameter (fp32, rtol 1e-5).
"""

import copy
import sys
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch


trl = pytest.importorskip("trl", reason="trl is an optional extra: pip install 'flowrl-toolkit[trl]'")

from datasets import Dataset  # noqa: E402  (trl's dependency)
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from flowrl.core import get_objective, list_objectives  # noqa: E402
from flowrl.llm.trl import FlowrlGRPOConfig, FlowrlGRPOTrainer, trl_loss_as_objective, turn_ids  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """trl's TrainingArguments initialise accelerate's process-wide state; later tests build their own
    `Accelerator(cpu=..., mixed_precision=...)`, which that state would refuse."""
    yield
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


B, P, T = 4, 3, 6  # rows, prompt length, completion length (= max_completion_length)
LENGTHS = [6, 4, 2, 5]  # valid completion tokens per row
ADVANTAGES = [1.0, -0.5, 0.7, -1.2]
GSPO_SHIFTS = [6e-4, -6e-4, 1e-4, -2e-4]  # sequence log-ratios: rows 0 and 1 clipped at GSPO's 3e-4 / 4e-4
OTHER_TOKENS = 13  # tokens of the other micro-batch of the generation batch (num_items_in_batch)
ACCUMULATION = 2
RTOL, ATOL = 1e-5, 1e-7

CHARS = "abcdefghijklmnopqrstuvwxyz "


def _tokenizer():
    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # one token per character
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def _model(seed=0):
    config = LlamaConfig(
        vocab_size=len(CHARS) + 2,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def _reward(completions, **kwargs):
    # completions of one prompt are consecutive: rewards 0, 1 in every group, so every advantage is nonzero
    return [float(i % 2) for i in range(len(completions))]


def _dataset():
    return Dataset.from_dict({"prompt": ["abc", "hello", "xyz", "qq"]})


def _common(path):
    return dict(
        output_dir=str(path),
        report_to=[],
        use_cpu=True,
        per_device_train_batch_size=B,
        num_generations=2,
        max_completion_length=T,
        gradient_accumulation_steps=ACCUMULATION,
        save_strategy="no",
        logging_steps=1,
    )


@pytest.fixture
def trainers(tmp_path):
    """trl's `GRPOTrainer` and a `FlowrlGRPOTrainer` on two copies of the same tiny model.

    Per test: building any `TrainingArguments` resets accelerate's shared state under earlier trainers.
    """
    tok, model = _tokenizer(), _model()
    twin = copy.deepcopy(model)
    args = GRPOConfig(**_common(tmp_path / "trl"))
    ref = GRPOTrainer(model, reward_funcs=_reward, args=args, train_dataset=_dataset(), processing_class=tok)
    args = FlowrlGRPOConfig(**_common(tmp_path / "flowrl"))
    ours = FlowrlGRPOTrainer(twin, reward_funcs=_reward, args=args, train_dataset=_dataset(), processing_class=tok)
    return ref, ours


TRAINER_DEFAULTS = {
    "loss_type": "dapo",
    "epsilon_low": 0.2,
    "epsilon_high": 0.2,
    "importance_sampling_level": "token",
    "beta": 0.0,
    "top_entropy_quantile": 1.0,
    "off_policy_mask_threshold": None,
    "use_vllm": False,
    "vllm_importance_sampling_correction": True,
    "entropy_coef": 0.0,
    "_entropy_bonus_enabled": False,
    "current_gradient_accumulation_steps": ACCUMULATION,
}
ARGS_DEFAULTS = {
    "delta": None,
    "sapo_temperature_pos": 1.0,
    "sapo_temperature_neg": 1.05,
    "use_bias_correction_kl": True,
}


def _configure(trainer, trainer_attrs=(), args_attrs=(), mode="train"):
    for key, value in {**TRAINER_DEFAULTS, **dict(trainer_attrs)}.items():
        setattr(trainer, key, value)
    for key, value in {**ARGS_DEFAULTS, **dict(args_attrs)}.items():
        setattr(trainer.args, key, value)
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    trainer.model.train(mode == "train")


def _inputs(
    trainer,
    *,
    seed=0,
    noise=0.5,
    gspo=False,
    ref=False,
    tool_mask=False,
    empty_row=False,
    is_ratio=False,
    adv_2d=False,
    advantages=ADVANTAGES,
):
    """A crafted micro-batch in trl's format, behaviour log-probs perturbed around the current ones."""
    g = torch.Generator().manual_seed(seed)
    vocab = trainer.model.config.vocab_size
    prompt_ids = torch.randint(2, vocab, (B, P), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_ids[0, 0], prompt_mask[0, 0] = 0, 0  # a left-padded prompt
    lengths = torch.tensor(LENGTHS)
    completion_mask = (torch.arange(T) < lengths[:, None]).long()
    if empty_row:
        completion_mask[2] = 0  # a fully masked row (mask_truncated_completions)
    completion_ids = torch.randint(2, vocab, (B, T), generator=g).masked_fill(completion_mask == 0, 0)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1), T
        )
    eps = noise * torch.randn(B, T, generator=g)
    if gspo:  # token noise with zero mean over each row, plus an exact sequence log-ratio per row
        m = completion_mask.float()
        eps = eps - (eps * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)
        eps = eps - torch.tensor(GSPO_SHIFTS)[:, None]
    advantages = torch.tensor(advantages)
    if adv_2d:
        advantages = advantages[:, None] * (1 + 0.5 * torch.rand(B, T, generator=g))
    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": advantages,
        "old_per_token_logps": logps + eps,  # ratio = exp(-eps)
        "num_items_in_batch": completion_mask.sum() + OTHER_TOKENS,
    }
    if ref:
        inputs["ref_per_token_logps"] = logps + 0.2 * torch.randn(B, T, generator=g)
    if tool_mask:
        tool = torch.ones(B, T, dtype=torch.long)
        tool[0, 1:3] = 0
        tool[3, 2] = 0
        inputs["tool_mask"] = tool
        inputs["num_items_in_batch"] = (completion_mask * tool).sum() + OTHER_TOKENS
    if is_ratio:
        inputs["importance_sampling_ratio"] = torch.tensor([[1.0], [0.7], [0.0], [1.3]])  # sequence_mask mode
    return inputs


def _loss_and_grads(trainer, inputs, compute_loss):
    trainer.model.zero_grad(set_to_none=True)
    loss = compute_loss(trainer, trainer.model, inputs)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _assert_parity(trainers, inputs):
    """trl's and flowrl's `_compute_loss` agree in value and in every parameter gradient; returns the metrics."""
    ref, ours = trainers
    loss_ref, grads_ref = _loss_and_grads(ref, inputs, GRPOTrainer._compute_loss)
    loss, grads = _loss_and_grads(ours, inputs, FlowrlGRPOTrainer._compute_loss)
    torch.testing.assert_close(loss, loss_ref, rtol=RTOL, atol=ATOL)
    assert grads.keys() == grads_ref.keys() and grads
    assert any(g.abs().max() > 0 for g in grads_ref.values()), "degenerate case: zero gradient"
    for name, grad in grads_ref.items():
        torch.testing.assert_close(grads[name], grad, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
    return ref._metrics, ours._metrics


BNPO = "bnpo" if "bnpo" in list_objectives() else "ppo"  # flowrl's bnpo is PPO-clip with a token mean

# id: (trl trainer attributes, trl args attributes, flowrl objective, objective_kwargs, token_mean_normalizer)
LOSS_CASES = {
    "grpo": ({"loss_type": "grpo"}, {}, "grpo", {"clip_eps_low": 0.2, "clip_eps_high": 0.2}, "global"),
    "dapo": (
        {"loss_type": "dapo", "epsilon_high": 0.28},
        {},
        "dapo",
        {"clip_eps_low": 0.2, "clip_eps_high": 0.28},
        "global",
    ),
    "dr_grpo": ({"loss_type": "dr_grpo"}, {}, "dr_grpo", {"norm_len": T}, "global"),
    "bnpo": ({"loss_type": "bnpo"}, {}, BNPO, {"clip_eps_low": 0.2}, "local"),
    "cispo": ({"loss_type": "cispo", "epsilon_high": 5.0}, {}, "cispo", {"clip_eps_high": 4.0}, "global"),
    "sapo": (
        {"loss_type": "sapo"},
        {"sapo_temperature_pos": 0.9, "sapo_temperature_neg": 1.3},
        "sapo",
        {"tau_pos": 0.9, "tau_neg": 1.3},
        "global",
    ),
    "gspo": (
        {"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon_low": 3e-4, "epsilon_high": 4e-4},
        {},
        "gspo",
        {"clip_eps_low": 3e-4, "clip_eps_high": 4e-4},
        "global",
    ),
    "gspo_dapo": (
        {"loss_type": "dapo", "importance_sampling_level": "sequence", "epsilon_low": 3e-4, "epsilon_high": 4e-4},
        {},
        "gspo",
        {"clip_eps_low": 3e-4, "clip_eps_high": 4e-4, "agg": "token_mean"},
        "global",
    ),
    "grpo_delta": ({"loss_type": "grpo"}, {"delta": 1.4}, "grpo", {"dual_clip_c": 1.4}, "global"),
}


def _setup(trainers, case, mode="train", trl_extra=(), args_extra=()):
    trl_attrs, args_attrs, objective, kwargs, normalizer = LOSS_CASES[case]
    ref, ours = trainers
    _configure(ref, {**trl_attrs, **dict(trl_extra)}, {**args_attrs, **dict(args_extra)}, mode)
    _configure(ours, trl_extra, args_extra, mode)
    ours.args.objective, ours.args.objective_kwargs, ours.args.token_mean_normalizer = objective, kwargs, normalizer


# eval mode changes the normalisers only (no accumulation): one case per normaliser kind
MODES = [(case, "train") for case in LOSS_CASES] + [(case, "eval") for case in ("grpo", "dapo", "bnpo")]


@pytest.mark.parametrize(("case", "mode"), MODES, ids=[f"{c}-{m}" for c, m in MODES])
def test_loss_types_match_trl(trainers, case, mode):
    _setup(trainers, case, mode)
    gspo = "gspo" in case
    inputs = _inputs(trainers[0], gspo=gspo, noise=0.5)
    metrics_ref, metrics = _assert_parity(trainers, inputs)
    m = {k: v[-1] for k, v in metrics[mode].items()}
    if case not in ("sapo", "cispo"):  # the trust region is exercised on both sides
        assert 0 < m["flowrl/clipfrac"] < 1
        assert m["flowrl/clipfrac_low"] > 0 and m["flowrl/clipfrac_high"] > 0
    if case == "grpo_delta":
        assert m["flowrl/clipfrac_dual"] > 0
    m_ref = {k: v[-1] for k, v in metrics_ref[mode].items()}
    assert m["entropy"] == pytest.approx(m_ref["entropy"], rel=1e-6)
    if not gspo and case not in ("sapo", "cispo"):  # trl counts a sequence ratio once per row, flowrl per token
        for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
            assert m[key] == pytest.approx(m_ref[key], rel=1e-6), key


FEATURE_CASES = {
    # id: (loss case, trl trainer attributes, trl args attributes, inputs options)
    "grpo_kl": ("grpo", {"beta": 0.04}, {}, {"ref": True}),
    "dapo_kl": ("dapo", {"beta": 0.04}, {}, {"ref": True}),
    "gspo_kl": ("gspo", {"beta": 0.04}, {}, {"ref": True, "gspo": True}),
    "dapo_kl_no_bias_correction": ("dapo", {"beta": 0.04}, {"use_bias_correction_kl": False}, {"ref": True}),
    "dapo_tool_mask": ("dapo", {}, {}, {"tool_mask": True}),
    "grpo_tool_mask": ("grpo", {}, {}, {"tool_mask": True}),
    "grpo_empty_row": ("grpo", {}, {}, {"empty_row": True}),
    "dr_grpo_empty_row": ("dr_grpo", {}, {}, {"empty_row": True}),
    "dapo_empty_row": ("dapo", {}, {}, {"empty_row": True}),
    "dapo_adv_2d": ("dapo", {}, {}, {"adv_2d": True}),
    "grpo_top_entropy": ("grpo", {"top_entropy_quantile": 0.5}, {}, {}),
    "dapo_off_policy_mask": ("dapo", {"off_policy_mask_threshold": 0.02}, {}, {}),
    "cispo_vllm_is": ("cispo", {"use_vllm": True}, {}, {"is_ratio": True}),
    "dapo_vllm_is": ("dapo", {"use_vllm": True}, {}, {"is_ratio": True}),
    "grpo_entropy_bonus": ("grpo", {"entropy_coef": 0.01, "_entropy_bonus_enabled": True}, {}, {}),
    "dapo_entropy_bonus": ("dapo", {"entropy_coef": 0.01, "_entropy_bonus_enabled": True}, {}, {}),
}


@pytest.mark.parametrize("case", list(FEATURE_CASES))
def test_trl_features_match_trl(trainers, case):
    """trl's KL (with and without bias correction), masks, vLLM IS ratio and entropy bonus are carried over."""
    loss_case, trl_extra, args_extra, options = FEATURE_CASES[case]
    _setup(trainers, loss_case, trl_extra=trl_extra, args_extra=args_extra)
    metrics_ref, metrics = _assert_parity(trainers, _inputs(trainers[0], **options))
    for key in ("kl", "policy_loss", "entropy_coef"):
        if key in metrics_ref["train"]:
            assert metrics["train"][key] == pytest.approx(metrics_ref["train"][key], rel=1e-5), key


def test_bnpo_equals_dapo_normaliser_on_the_local_batch(trainers):
    """With one micro-batch per window and its own token count as `num_items_in_batch`, local == global."""
    _setup(trainers, "bnpo")
    inputs = _inputs(trainers[0])
    inputs["num_items_in_batch"] = inputs["completion_mask"].sum()
    for trainer in trainers:
        trainer.current_gradient_accumulation_steps = 1
        trainer.args.steps_per_generation = 1
    try:
        trainers[1].args.token_mean_normalizer = "global"
        _assert_parity(trainers, inputs)
    finally:
        for trainer in trainers:
            trainer.args.steps_per_generation = ACCUMULATION


def test_dr_grpo_norm_len_defaults_to_max_completion_length(trainers):
    """Without `norm_len`, `seq_mean_token_sum_norm` divides by trl's `max_completion_length`, not the padded K."""
    _setup(trainers, "dr_grpo")
    for trainer in trainers:
        trainer.max_completion_length = T + 2
    trainers[1].args.objective_kwargs = {}
    _assert_parity(trainers, _inputs(trainers[0]))


def _extra_case(trainers, loss_type, trl_attrs, args_attrs, inputs):
    """Parity for a trl loss type flowrl added later: the flowrl config is `trl_loss_as_objective`'s."""
    if loss_type not in list_objectives():
        pytest.skip(f"flowrl has no {loss_type} objective yet")
    ref, ours = trainers
    _configure(ref, {"loss_type": loss_type, **trl_attrs}, args_attrs)
    _configure(ours)
    attrs = {**TRAINER_DEFAULTS, **ARGS_DEFAULTS, **trl_attrs, **args_attrs}
    config = SimpleNamespace(
        loss_type=loss_type,
        epsilon=attrs["epsilon_low"],
        epsilon_high=attrs["epsilon_high"],
        delta=None,
        importance_sampling_level=attrs["importance_sampling_level"],
        max_completion_length=T,
        **{
            k: attrs.get(k, ref.args.__dict__[k])
            for k in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")
        },
    )
    mapped = trl_loss_as_objective(config)
    assert mapped["objective"] == loss_type
    for key, value in mapped.items():
        setattr(ours.args, key, value)
    return _assert_parity(trainers, _inputs(ref, **inputs))[1]["train"]


def test_luspo_matches_trl(trainers):
    """LUSPO (arXiv:2602.05261): GSPO's clipped sequence ratio times the length, trl's `(l * m).sum(-1).mean()`."""
    trl_attrs = {"importance_sampling_level": "sequence", "epsilon_low": 3e-4, "epsilon_high": 4e-4}
    metrics = _extra_case(trainers, "luspo", trl_attrs, {}, {"gspo": True})
    assert 0 < metrics["flowrl/clipfrac"][-1] < 1


def test_vespo_matches_trl(trainers):
    """VESPO (arXiv:2602.10693): the Gamma weight of the sequence product ratio on REINFORCE, global token mean."""
    args_attrs = {"vespo_k_pos": 1.5, "vespo_lambda_pos": 2.5, "vespo_k_neg": 2.5, "vespo_lambda_neg": 1.5}
    # mostly positive advantages: a loss of mixed-sign terms cancelling to ~1e-4 would test fp32 rounding only
    _extra_case(trainers, "vespo", {}, args_attrs, {"noise": 0.1, "advantages": [1.0, 0.5, 0.7, -0.3]})


def _resolved(objective, kwargs):
    obj = get_objective(objective)
    hparams = {"agg": obj.agg, **obj.hparams, **kwargs}
    if "clip_eps_high" in hparams and hparams["clip_eps_high"] is None:  # None means "= clip_eps_low"
        hparams["clip_eps_high"] = hparams["clip_eps_low"]
    return objective, hparams


@pytest.mark.parametrize("case", list(LOSS_CASES))
def test_trl_loss_as_objective(case):
    """The translation of a trl loss config is the mapping the parity cases pin."""
    trl_attrs, args_attrs, objective, kwargs, normalizer = LOSS_CASES[case]
    attrs = {**trl_attrs, **args_attrs}
    config = SimpleNamespace(
        loss_type=attrs["loss_type"],
        epsilon=attrs.get("epsilon_low", 0.2),
        epsilon_high=attrs.get("epsilon_high"),
        delta=attrs.get("delta"),
        importance_sampling_level=attrs.get("importance_sampling_level", "token"),
        sapo_temperature_pos=attrs.get("sapo_temperature_pos", 1.0),
        sapo_temperature_neg=attrs.get("sapo_temperature_neg", 1.05),
        max_completion_length=T,
    )
    mapped = trl_loss_as_objective(config)
    assert mapped["token_mean_normalizer"] == normalizer
    assert _resolved(mapped["objective"], mapped["objective_kwargs"]) == _resolved(objective, kwargs)


def test_trl_loss_as_objective_rejects_what_flowrl_cannot_express():
    config = SimpleNamespace(
        loss_type="grpo",
        epsilon=0.2,
        epsilon_high=None,
        delta=1.1,
        importance_sampling_level="token",
        max_completion_length=T,
    )
    with pytest.raises(ValueError, match="delta"):
        trl_loss_as_objective(config)
    config = SimpleNamespace(loss_type="cispo", epsilon=0.2, epsilon_high=5.0, importance_sampling_level="sequence")
    with pytest.raises(ValueError, match="no flowrl equivalent"):
        trl_loss_as_objective(config)


def test_config_validation(tmp_path):
    with pytest.raises(ValueError, match="unknown objective 'gspoo'.*'gspo'"):
        FlowrlGRPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, objective="gspoo")
    with pytest.raises(ValueError, match="unknown hyper-parameter 'clip_high'"):
        FlowrlGRPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, objective_kwargs={"clip_high": 1})
    args = FlowrlGRPOConfig(
        output_dir=str(tmp_path),
        report_to=[],
        use_cpu=True,
        objective="gspo",
        objective_kwargs='{"clip_eps_high": 5e-4, "agg": "token_mean"}',
    )
    assert args.objective_kwargs == {"clip_eps_high": 5e-4, "agg": "token_mean"}
    assert FlowrlGRPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True).token_mean_normalizer == "global"
    bnpo = FlowrlGRPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, objective=BNPO)
    assert bnpo.token_mean_normalizer == ("local" if BNPO == "bnpo" else "global")
    with pytest.warns(UserWarning, match="ignores trl's loss_type"):
        FlowrlGRPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, loss_type="grpo")


@pytest.mark.parametrize(
    ("objective", "reason"),
    [("troll", "top-k next-token log-probs"), ("trpa", "group"), ("reg_grpo", "group"), ("gtpo", "group")],
)
def test_objectives_trl_cannot_feed_are_refused_in_one_line(tmp_path, objective, reason):
    """TROLL needs top-k supports trl never computes; the group objectives need whole groups in one loss call,
    which trl's shuffled micro-batches do not give: refused with the reason and where they do train."""
    with pytest.raises(ValueError, match=rf"{objective}.*{reason}.*configs/llm/arith_{objective}\.yaml\)$"):
        FlowrlGRPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, objective=objective)


def test_plain_grpo_config_is_rejected(tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, num_generations=2)
    with pytest.raises(TypeError, match="FlowrlGRPOConfig"):
        FlowrlGRPOTrainer(
            _model(), reward_funcs=_reward, args=args, train_dataset=_dataset(), processing_class=_tokenizer()
        )


def test_missing_trl_gives_a_one_line_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "trl", None)  # `import trl` now raises ImportError
    monkeypatch.delitem(sys.modules, "flowrl.llm.trl")
    with pytest.raises(ImportError, match=r"pip install 'flowrl-toolkit\[trl\]'"):
        import flowrl.llm.trl  # noqa: F401


def test_turn_ids():
    completion_mask = torch.ones(2, 7, dtype=torch.long)
    tool_mask = torch.tensor([[1, 1, 0, 0, 1, 0, 1], [1, 1, 1, 1, 1, 1, 1]])
    assert turn_ids(completion_mask).eq(0).all()
    assert turn_ids(completion_mask, tool_mask).tolist() == [[0, 0, 0, 0, 1, 1, 2], [0] * 7]


@pytest.mark.parametrize("objective", ["high_entropy", "r2vpo", "clip_cov", "turn_ppo", "espo"])
def test_objectives_with_extra_inputs_run(trainers, objective):
    """Objectives that take entropies, a controller state or segment ids get them from the trainer."""
    if objective not in list_objectives():
        pytest.skip(f"flowrl has no {objective} objective yet")
    _, ours = trainers
    _configure(ours)
    ours.args.objective, ours.args.objective_kwargs, ours.args.token_mean_normalizer = objective, {}, "global"
    ours.objective_state = None
    for _ in range(2):  # a stateful objective updates its state in place
        loss, grads = _loss_and_grads(ours, _inputs(ours, tool_mask=True), FlowrlGRPOTrainer._compute_loss)
        assert torch.isfinite(loss) and any(g.abs().max() > 0 for g in grads.values())
    if get_objective(objective).init_state is not None:
        assert ours.objective_state is not None


@pytest.mark.parametrize("diagnostics", ["clip", "full"])
def test_trainer_trains_one_step(tmp_path, diagnostics):
    model = _model(seed=1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    kwargs = {"clip_eps_high": 5e-4} if diagnostics == "clip" else {"clip_eps_high": 5e-4, "diagnostics": "full"}
    args = FlowrlGRPOConfig(
        **{**_common(tmp_path), "max_completion_length": 4, "gradient_accumulation_steps": 1},
        objective="gspo",
        objective_kwargs=kwargs,
        max_steps=1,
        learning_rate=1e-2,
        disable_tqdm=True,
    )
    trainer = FlowrlGRPOTrainer(
        model, reward_funcs=_reward, args=args, train_dataset=_dataset(), processing_class=_tokenizer()
    )
    trainer.train()
    changed = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert changed
    logged = trainer.state.log_history[0]
    assert "flowrl/clipfrac" in logged and "clip_ratio/region_mean" in logged
    if diagnostics == "clip":  # the default: trl's metric set
        assert "flowrl/ratio_mean" not in logged
    else:
        assert logged["flowrl/ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # on-policy: the ratio is 1
        assert logged["flowrl/ratio_min"] <= 1.0 + 1e-6 <= logged["flowrl/ratio_max"] + 2e-6
