"""eval.py hf=: tiny random transformers models of five architectures under lenext's protocols, against a plain
transformers forward over the same windows written here from the protocols' definitions (docs/hf.md)."""

import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch.testing import assert_close

from lenext.data import TextFiles
from lenext.data.tokenizer import EOS, train_tokenizer
from lenext.errors import ConfigError
from lenext.hf import HFLanguageModel, evaluate_hf, load_model
from tests.conftest import needs_transformers_models
from tests.test_evaluate import compose_eval

pytestmark = needs_transformers_models  # the HF bridge, which lenext refuses where transformers runs no model

VOCAB = 300
CONTEXT = 32  # every tiny model's max_position_embeddings: eval.factors multiply it


def tiny_config(architecture: str):
    import transformers

    shape = {"vocab_size": VOCAB, "initializer_range": 0.5}  # weights large enough that positions matter
    if architecture == "gpt2":
        return transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=2 * CONTEXT, **shape)
    if architecture == "bloom":
        return transformers.BloomConfig(hidden_size=32, n_layer=2, n_head=4, **shape)
    common = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": CONTEXT}
    if architecture == "gpt_neox":
        return transformers.GPTNeoXConfig(intermediate_size=64, rotary_pct=0.5, **common, **shape)
    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[architecture]
    return config_class(intermediate_size=64, num_key_value_heads=2, **common, **shape)


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory, small_text_corpus):
    """A byte-level BPE of VOCAB tokens as a transformers tokenizer folder (what a model folder holds)."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = train_tokenizer(TextFiles(str(small_text_corpus)).documents("train"), VOCAB)
    folder = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=EOS, eos_token=EOS).save_pretrained(folder)
    return folder


def model_folder(tmp_path, tokenizer_folder, architecture: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    folder = tmp_path / architecture
    AutoModelForCausalLM.from_config(tiny_config(architecture)).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer_folder).save_pretrained(folder)
    return folder


def compose_hf(tmp_path, corpus, folder, *overrides):
    """eval.py's config for ``hf=folder`` on the small text corpus, written to tmp_path/out."""
    data = ("data=text_files", f"data.corpus.path={corpus}", "data.corpus.holdout_every=4")
    return compose_eval(tmp_path, tmp_path / "out", "null", f"hf={folder}", *data, *overrides)


def byte_lengths(tokenizer_folder) -> dict[int, int]:
    """Each token's bytes, from the byte-level alphabet (GPT-2's bytes_to_unicode), not from lenext's offsets."""
    tokenizer = Tokenizer.from_file(str(tokenizer_folder / "tokenizer.json"))
    return {i: (0 if token == EOS else len(token)) for token, i in tokenizer.get_vocab().items()}


def reference_rows(model, documents, lengths, protocol, k, max_windows, block):
    """(ppl, targets, scored spans) per length from a plain forward of the whole model over each window, by the
    definitions: nonoverlap: disjoint windows of L + 1 tokens, every target; last_k: blocks of the longest length,
    the last k targets of each with the L tokens before them as context (``block``: the sweep's longest length);
    eval.max_windows: every ceil(n / max)-th."""
    rows = {}
    for length in lengths:
        total, count, scored_spans, windows = 0.0, 0, [], []
        for d, doc in enumerate(documents):
            if protocol == "nonoverlap":
                windows += [(d, w * length, 0) for w in range((len(doc) - 1) // length)]
            else:
                windows += [(d, (b + 1) * block - length, length - k) for b in range((len(doc) - 1) // block)]
        for d, start, score_from in windows[:: math.ceil(len(windows) / max_windows)]:
            ids = torch.tensor(documents[d][start : start + length + 1], dtype=torch.long)[None]
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=ids[:, :-1]).logits.double(), -1)[0]
            nll = -logp[torch.arange(length), ids[0, 1:]]
            total, count = total + nll[score_from:].sum().item(), count + length - score_from
            scored_spans.append((d, start + 1 + score_from, start + length))
        rows[length] = (math.exp(total / count), count, scored_spans)
    return rows


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "gpt_neox", "bloom", "gpt2"])
def test_each_protocol_equals_a_plain_transformers_loop(architecture, tmp_path, small_text_corpus, tokenizer_folder):
    folder = model_folder(tmp_path, tokenizer_folder, architecture)
    overrides = ("eval.lengths=[32,64,128]", "eval.protocol=[nonoverlap,last_k]", "eval.last_k=8", "eval.max_windows=6")
    context = [f"context={CONTEXT}"] if architecture == "bloom" else []  # ALiBi: its config says no context
    evaluate_hf(compose_hf(tmp_path, small_text_corpus, folder, *overrides, *context))
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    context = 2 * CONTEXT if architecture == "gpt2" else CONTEXT  # GPT-2's trained context is its table's size
    assert results["meta"]["row"] == f"hf:{architecture}" and results["meta"]["train_len"] == context
    assert results["meta"]["versions"]["transformers"] and results["meta"]["python"]  # as a run's results record
    model = load_model(str(folder))
    from lenext.data import LMDataModule

    data = LMDataModule(
        TextFiles(str(small_text_corpus), holdout_every=4), tokenizer=str(folder), cache_dir=str(tmp_path / "c")
    )
    data.load()
    documents = data.documents("validation")
    sizes = byte_lengths(tokenizer_folder)
    for protocol in ("nonoverlap", "last_k"):
        served = [32, 64] if architecture == "gpt2" else [32, 64, 128]
        expected = reference_rows(model, documents, served, protocol, k=8, max_windows=6, block=128)
        for row in (r for r in results["rows"] if r["protocol"] == protocol):
            if architecture == "gpt2" and row["length"] > 2 * CONTEXT:  # learned positions: n/a beyond its table
                assert row["status"] == "not applicable" and row["ppl"] is None
                continue
            ppl, tokens, spans = expected[row["length"]]
            assert row["status"] == "ok" and row["tokens"] == tokens
            assert row["ppl"] == pytest.approx(ppl, rel=1e-5)
            scored_bytes = sum(sizes[int(t)] for d, first, last in spans for t in documents[d][first : last + 1])
            assert row["bytes"] == scored_bytes
            assert row["bits_per_byte"] == pytest.approx(math.log(ppl) * tokens / math.log(2) / scored_bytes, rel=1e-5)


@pytest.mark.parametrize("variant,rope_type", [("linear", "linear"), ("yarn", "yarn"), ("llama3", "llama3")])
def test_a_rope_variant_is_transformers_own_scaling_at_l_over_c(variant, rope_type, tmp_path, tokenizer_folder):
    """At L = 4 C the rotary module holds transformers' frequencies for rope_type with factor 4 and C as the
    original context; as trained again after the variant."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    net = HFLanguageModel(load_model(str(model_folder(tmp_path, tokenizer_folder, "llama"))))
    rotary = net.model.model.rotary_emb
    trained = rotary.inv_freq.clone()
    reference = LlamaConfig(**{**tiny_config("llama").to_dict()})
    reference.rope_parameters = {"rope_type": rope_type, "rope_theta": 10000.0, "factor": 4.0}
    reference.rope_parameters |= {"original_max_position_embeddings": CONTEXT}
    if rope_type == "llama3":
        reference.rope_parameters |= {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
    expected, attention = ROPE_INIT_FUNCTIONS[rope_type](reference)
    assert net.pe.variants([variant], 4 * CONTEXT) == [None, variant]
    with net.pe.variant(variant):
        net.token_nll(torch.zeros(1, 4 * CONTEXT, dtype=torch.long), torch.zeros(1, 4 * CONTEXT, dtype=torch.long))
        assert net.pe.scaling_factor(4 * CONTEXT) == 4.0
        assert_close(net.model.model.rotary_emb.inv_freq, expected)
        assert net.model.model.rotary_emb.attention_scaling == pytest.approx(attention)
    net.token_nll(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long))
    assert_close(net.model.model.rotary_emb.inv_freq, trained)


def test_what_cannot_be_evaluated_is_refused_in_one_line_before_any_work(tmp_path, small_text_corpus, tokenizer_folder):
    folder = model_folder(tmp_path, tokenizer_folder, "llama")
    refusals = {
        (f"hf={tmp_path / 'none'}",): r"^hf='.*none' does not exist",
        ("eval.variants=[ntk]",): r"^eval.variants=\['ntk'\] is invalid for a Hugging Face model: ntk is not a scaling",
        ("ckpt=x.ckpt",): r"^ckpt=x.ckpt and hf=.*: give one",
        ("data.tokenizer=/other",): r"^data.tokenizer=/other is invalid with hf=",
        ("pe.scaling=yarn",): r"^pe.scaling applies to ckpt=; a Hugging Face model's scalings are eval.variants",
    }
    for overrides, message in refusals.items():
        with pytest.raises(ConfigError, match=message):
            evaluate_hf(compose_hf(tmp_path, small_text_corpus, folder, *overrides))
    (tmp_path / "tokenizer_only").mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "tokenizer_only" / name).write_text((folder / name).read_text())
    with pytest.raises(ConfigError, match=r"^hf='.*tokenizer_only' holds no config.json: give a Hugging Face model"):
        evaluate_hf(compose_hf(tmp_path, small_text_corpus, tmp_path / "tokenizer_only"))
    (tmp_path / "model_only").mkdir()  # a model's config without its tokenizer: hf= named, not data.tokenizer
    (tmp_path / "model_only" / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(
        ConfigError, match=r"^hf='.*model_only' holds no tokenizer transformers can load \(none of tokenizer.json, "
    ):
        evaluate_hf(compose_hf(tmp_path, small_text_corpus, tmp_path / "model_only"))
    from transformers import AutoModelForCausalLM

    # GPT-NeoX's weights without a tokenizer (a probe's export): transformers made an empty one, and every row of the
    # results read "no windows"
    AutoModelForCausalLM.from_config(tiny_config("gpt_neox")).save_pretrained(tmp_path / "neox_only")
    with pytest.raises(ConfigError, match=r"^hf='.*neox_only' holds no tokenizer transformers can load \(none of "):
        evaluate_hf(compose_hf(tmp_path, small_text_corpus, tmp_path / "neox_only"))
    assert not (tmp_path / "out" / "results.json").exists()
    shutil.copytree(folder, tmp_path / "truncated")  # a download cut short: safetensors' own error, not a traceback
    weights = tmp_path / "truncated" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ConfigError, match=r"^hf='.*truncated' holds no weights transformers can load \("):
        evaluate_hf(compose_hf(tmp_path, small_text_corpus, tmp_path / "truncated"))
    shutil.copytree(folder, tmp_path / "bad_config")  # the config named, not the tokenizer that also reads it
    (tmp_path / "bad_config" / "config.json").write_text("{not json")
    with pytest.raises(
        ConfigError, match=r"^hf='.*bad_config' holds no model config transformers can read \(.*not a valid JSON"
    ):
        evaluate_hf(compose_hf(tmp_path, small_text_corpus, tmp_path / "bad_config"))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    small = tiny_config("llama")
    small.vocab_size = VOCAB // 2  # another model's tokenizer: refused with both sizes, before the corpus is read
    AutoModelForCausalLM.from_config(small).save_pretrained(tmp_path / "small_vocab")
    AutoTokenizer.from_pretrained(tokenizer_folder).save_pretrained(tmp_path / "small_vocab")
    with pytest.raises(
        ConfigError, match=rf"its tokenizer has {VOCAB} token ids, more than the {VOCAB // 2} its model"
    ):
        evaluate_hf(compose_hf(tmp_path, small_text_corpus, tmp_path / "small_vocab"))
    # Without tokenizer_config.json transformers builds GPT-NeoX's tokenizer, which adds its pad token: not "another
    # model's tokenizer", the missing file is named.
    (model_folder(tmp_path, tokenizer_folder, "gpt_neox") / "tokenizer_config.json").unlink()
    with pytest.raises(ConfigError, match=r"\('<\|padding\|>' beyond them\): the folder has no tokenizer_config.json"):
        evaluate_hf(compose_hf(tmp_path, small_text_corpus, tmp_path / "gpt_neox"))
    assert not (tmp_path / "out").exists() and not (tmp_path / ".cache").exists()


def test_an_eval_sweep_checks_every_jobs_plan_against_the_models_context_before_the_first_starts(
    tmp_path, small_text_corpus, tokenizer_folder
):
    """eval.py -m hf=: a job's lengths are checked against the context the model's config says, before any weights
    load; not by the job, after the jobs before it ran."""
    from lenext.cli import check_overrides

    folder = model_folder(tmp_path, tokenizer_folder, "llama")
    data = ["data=text_files", f"data.corpus.path={small_text_corpus}", "data.corpus.holdout_every=4"]
    with pytest.raises(
        ConfigError, match=r"^job 1 of the sweep \(eval.factors=\[0.01\]\): .* \(of L_train 32\); no job"
    ):
        check_overrides("eval", [f"hf={folder}", *data, "eval.factors=[1],[0.01]"], multirun=True)


def test_a_lenext_model_trains_on_a_tokenizer_from_outside(
    compose_train, small_text_corpus, tokenizer_folder, tmp_path
):
    """data.tokenizer: the run's vocabulary is the tokenizer's (no BPE trained), recorded in its results and run
    description; a second stage on another tokenizer is refused before any work."""
    from lenext.run import train

    overrides = [
        "model=tiny",
        "data=text_files",
        f"data.corpus.path={small_text_corpus}",
        "data.corpus.holdout_every=4",
    ]
    overrides += ["data.max_len=32", "data.batch_size=4", "trainer=cpu", "trainer.max_steps=2", "eval.lengths=[32]"]
    train(compose_train(*overrides, f"data.tokenizer={tokenizer_folder}"))
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["meta"]["vocab_size"] == VOCAB and results["meta"]["run"]["config"]["data"]["tokenizer"] == str(
        tokenizer_folder
    )
    base = tmp_path / "checkpoints" / "last.ckpt"
    # Exported, its tokenizer (the folder's own) puts the start token before text, as the run's documents have it.
    from transformers import AutoTokenizer

    from lenext.export import export

    export(str(base), str(tmp_path / "exported"), cache_dir=str(tmp_path / ".cache"))
    exported = AutoTokenizer.from_pretrained(tmp_path / "exported")
    own = AutoTokenizer.from_pretrained(tokenizer_folder)
    text = "the state of the union"
    assert exported(text)["input_ids"] == [exported.bos_token_id, *own(text, add_special_tokens=False)["input_ids"]]
    assert exported.bos_token == EOS and own(text)["input_ids"][0] != own.bos_token_id  # the folder's own adds none
    stage = compose_train(*overrides, f"init_from={base}", "data.tokenizer=null", f"paths.output_dir={tmp_path / 's'}")
    with pytest.raises(ConfigError, match=r"^data.tokenizer=None is invalid for a second stage: .* data.tokenizer="):
        train(stage)


def test_dynamic_ntk_follows_each_sequences_length_as_transformers_defines_it(tmp_path, tokenizer_folder):
    """The dynamic variant's rotary module grows its base with the length of each forward pass: at 4C it holds
    transformers' dynamic-NTK frequencies for seq_len 4C (factor 1, lenext's default), equal to lenext's own."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from lenext.pe.rope import rope_frequencies

    net = HFLanguageModel(load_model(str(model_folder(tmp_path, tokenizer_folder, "llama"))))
    with net.pe.variant("dynamic_ntk"):
        tokens = torch.zeros(1, 4 * CONTEXT, dtype=torch.long)
        net.token_nll(tokens, tokens)
        rotary = net.model.model.rotary_emb
        expected, _ = ROPE_INIT_FUNCTIONS["dynamic"](rotary.config, seq_len=4 * CONTEXT)
        assert_close(rotary.inv_freq, expected)
        head_dim = net.model.config.hidden_size // net.model.config.num_attention_heads
        lenext, _ = rope_frequencies(head_dim, 10000.0, "dynamic_ntk", 1.0, 4 * CONTEXT, CONTEXT)
        assert_close(rotary.inv_freq.double(), lenext, rtol=1e-6, atol=0)


def test_a_dynamic_row_is_the_model_as_trained_up_to_c_in_every_protocol(tmp_path, small_text_corpus, tokenizer_folder):
    """Dynamic NTK grows its base with each sequence beyond C only: at L = C, after a longer length of another
    protocol, its rows equal the model as trained (its module keeps no longer length)."""
    folder = model_folder(tmp_path, tokenizer_folder, "llama")
    overrides = ("eval.lengths=[32,128]", "eval.protocol=[nonoverlap,last_k]", "eval.variants=[dynamic_ntk]")
    evaluate_hf(compose_hf(tmp_path, small_text_corpus, folder, *overrides, "eval.max_windows=4"))
    rows = json.loads((tmp_path / "out" / "results.json").read_text())["rows"]
    at = {(r["protocol"], r["variant"], r["length"]): r["mean_nll"] for r in rows}
    for protocol in ("nonoverlap", "last_k"):
        assert at[(protocol, "dynamic_ntk", 32)] == pytest.approx(at[(protocol, None, 32)], rel=1e-6)
        assert at[(protocol, "dynamic_ntk", 128)] != pytest.approx(at[(protocol, None, 128)], rel=1e-4)


def test_a_model_whose_own_rope_is_dynamic_is_scored_at_each_length_as_a_fresh_transformers_forward(
    tmp_path, tokenizer_folder
):
    """transformers' dynamic module keeps the longest length it saw (it resets only below C), so one module kept
    over a sweep scored every length after a longer one with that one's frequencies."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_config("llama")
    config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "dynamic")
    net = HFLanguageModel(load_model(str(tmp_path / "dynamic")))
    tokens = torch.randint(0, VOCAB, (1, 8 * CONTEXT + 1))
    scored = {length: net.token_nll(tokens[:, :length], tokens[:, 1 : length + 1]) for length in (256, 64, 48)}
    for length in (64, 48):  # each after a longer one, against a model that saw only this length
        fresh = load_model(str(tmp_path / "dynamic"))
        with torch.no_grad():
            logits = fresh(input_ids=tokens[:, :length], use_cache=False).logits
        expected = F.cross_entropy(logits[0], tokens[0, 1 : length + 1], reduction="none")
        assert_close(scored[length][0], expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match=r"Self-Extend cannot patch it, its own RoPE is dynamic"):
        net.pe.variants(["self_extend"], 4 * CONTEXT)


@pytest.mark.parametrize(
    "settings,reason",
    [
        ({"sliding_window": 24}, r"it attends through a sliding window \(sliding_window=24\)"),
        ({"attn_logit_softcapping": 50.0}, r"it caps its logits \(attn_logit_softcapping=50.0\)"),
    ],
)
def test_self_extend_refuses_a_window_or_capped_logits_it_would_drop(settings, reason, tmp_path, tokenizer_folder):
    """Self-Extend's attention keeps neither; a window as long as its 24-token check would pass the check unseen."""
    net = HFLanguageModel(load_model(str(model_folder(tmp_path, tokenizer_folder, "llama"))))
    for key, value in settings.items():
        setattr(net.model.config, key, value)
    with pytest.raises(ConfigError, match=r"^eval.variants=\['self_extend'\] is invalid for this model: Self-Extend "
                       r"cannot patch it, " + reason):  # fmt: skip
        net.pe.variants(["self_extend"], 4 * CONTEXT)


def test_a_key_evaluator_of_another_vocabulary_is_refused_in_one_line_for_a_hugging_face_model(
    tmp_path, tokenizer_folder, monkeypatch
):
    """The judge's vocabulary is checked against the evaluated model's embedding (an HF model has no vocab_size
    attribute: this raised AttributeError)."""
    import lenext.checkpoints
    from lenext.protocols import evaluator_net

    net = HFLanguageModel(load_model(str(model_folder(tmp_path, tokenizer_folder, "llama"))))
    monkeypatch.setattr(lenext.checkpoints, "load_checkpoint", lambda path, key: {})
    monkeypatch.setattr(lenext.checkpoints, "net_state", lambda checkpoint: {"embedding.weight": torch.zeros(512, 4)})
    with pytest.raises(ConfigError, match=r"^eval.key_evaluator='judge.ckpt' has a vocabulary of 512 tokens, the "
                       r"evaluated model 300: it must be a run on the same data and tokenizer$"):  # fmt: skip
        evaluator_net("judge.ckpt", net)


def test_the_trained_context_is_the_one_given_then_a_lenext_exports_then_a_scalings_original_then_the_window():
    """A lenext run under YaRN trained at L_train 32 from an original context of 16 is exported with both: its
    evaluation's lengths are factors of 32, as the checkpoint's are."""
    from transformers import LlamaConfig, Phi3Config

    from lenext.hf import trained_context

    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}
    assert trained_context(LlamaConfig(max_position_embeddings=64, rope_parameters=yarn)) == 16
    assert trained_context(LlamaConfig(max_position_embeddings=64)) == 64
    exported = LlamaConfig(max_position_embeddings=32, rope_parameters=yarn, lenext_context=32)
    assert trained_context(exported) == 32 and trained_context(exported, given=128) == 128
    # Phi-3's long models keep the original context at the config's top level, beside LongRoPE's factors
    longrope = {"rope_type": "longrope", "short_factor": [1.0] * 48, "long_factor": [4.0] * 48}
    phi3 = Phi3Config(max_position_embeddings=131072, original_max_position_embeddings=4096, rope_scaling=longrope)
    assert trained_context(phi3) == 4096


def test_partial_rotary_stays_partial_under_a_variant(tmp_path, tokenizer_folder):
    """GPT-NeoX rotates a share of each head (rotary_pct): a scaling keeps that share."""
    net = HFLanguageModel(load_model(str(model_folder(tmp_path, tokenizer_folder, "gpt_neox"))))
    trained = net.model.base_model.rotary_emb.inv_freq.clone()
    with net.pe.variant("yarn"):
        tokens = torch.zeros(1, 4 * CONTEXT, dtype=torch.long)
        net.token_nll(tokens, tokens)
        assert net.model.base_model.rotary_emb.inv_freq.shape == trained.shape
        assert not torch.equal(net.model.base_model.rotary_emb.inv_freq, trained)
    assert torch.equal(net.model.base_model.rotary_emb.inv_freq, trained)


def test_variants_of_a_model_without_rope_and_an_encoder_are_refused(tmp_path, small_text_corpus, tokenizer_folder):
    import transformers

    folder = model_folder(tmp_path, tokenizer_folder, "gpt2")
    with pytest.raises(ConfigError, match=r"^eval.variants=\['yarn'\] is invalid for this model: it has no RoPE"):
        evaluate_hf(compose_hf(tmp_path, small_text_corpus, folder, "eval.variants=[yarn]"))
    # Self-Extend undoes and redoes the model's rotation: a rotary module that turns part of the head is refused.
    neox = model_folder(tmp_path, tokenizer_folder, "gpt_neox")  # rotary_pct 0.5
    with pytest.raises(ConfigError, match=r"^eval.variants=\['self_extend'\] is invalid for this model: Self-Extend "
                       r"cannot patch it, it rotates part of each head \(partial_rotary_factor=0.5\)"):  # fmt: skip
        evaluate_hf(compose_hf(tmp_path, small_text_corpus, neox, "eval.variants=[self_extend]"))
    phi = tmp_path / "phi"  # its attention failed on the patch's shapes: a RuntimeError's text was the reason given
    config = transformers.PhiConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, partial_rotary_factor=0.5,
        max_position_embeddings=CONTEXT, vocab_size=VOCAB,
    )  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(phi)
    transformers.AutoTokenizer.from_pretrained(tokenizer_folder).save_pretrained(phi)
    with pytest.raises(ConfigError, match=r"cannot patch it, it rotates part of each head \(partial_rotary_factor"):
        evaluate_hf(compose_hf(tmp_path, small_text_corpus, phi, "eval.variants=[self_extend]"))
    bert = tmp_path / "bert"
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4)
    transformers.BertLMHeadModel(config).save_pretrained(bert)
    with pytest.raises(ConfigError, match=r"is not causal \(a later token changes an earlier position's logits\)"):
        load_model(str(bert))
    # An encoder-decoder has no causal LM at all: said first, not after the context its config lacks.
    t5 = tmp_path / "t5"
    config = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4)
    transformers.T5ForConditionalGeneration(config).save_pretrained(t5)
    transformers.AutoTokenizer.from_pretrained(tokenizer_folder).save_pretrained(t5)
    with pytest.raises(ConfigError, match=r"T5Config is not a causal LM \(an encoder-decoder"):
        evaluate_hf(compose_hf(tmp_path, small_text_corpus, t5))
    bart = tmp_path / "bart"  # transformers' BartForCausalLM is its decoder alone: scored without its encoder
    config = transformers.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=CONTEXT,
    )  # fmt: skip
    transformers.BartForConditionalGeneration(config).save_pretrained(bart)
    transformers.AutoTokenizer.from_pretrained(tokenizer_folder).save_pretrained(bart)
    with pytest.raises(ConfigError, match=r"BartConfig is not a causal LM \(an encoder-decoder"):
        evaluate_hf(compose_hf(tmp_path, small_text_corpus, bart))


def test_bf16_evaluation_stays_near_fp32(tmp_path, small_text_corpus, tokenizer_folder):
    """eval.py hf= precision=bf16-mixed (autocast, whatever this CPU prefers) against the fp32 rows: bf16's
    rounding moves the mean NLL by well under 1%, and every row is measured."""
    folder = model_folder(tmp_path, tokenizer_folder, "llama")
    rows = {}
    for precision in ("32-true", "bf16-mixed"):
        evaluate_hf(
            compose_hf(
                tmp_path / precision, small_text_corpus, folder, "eval.lengths=[32,64]", f"precision={precision}"
            )
        )
        results = json.loads((tmp_path / precision / "out" / "results.json").read_text())
        assert results["meta"]["precision"] == precision
        rows[precision] = [r["mean_nll"] for r in results["rows"]]
    assert rows["bf16-mixed"] == pytest.approx(rows["32-true"], rel=1e-2)
    assert rows["bf16-mixed"] != rows["32-true"]  # autocast did run in bf16


@pytest.mark.parametrize(
    "architecture,precision", [("llama", "32-true"), ("qwen2", "32-true"), ("llama", "bf16-mixed")]
)
def test_self_extend_patches_llama_like_models_and_is_the_model_within_c(
    architecture, precision, tmp_path, small_text_corpus, tokenizer_folder
):
    """Models with grouped-query attention (2 key heads for 4) take the patch; within C its group is 1 and its rows
    are the model's own (in bf16 within its rounding), beyond C they differ (lenext's Self-Extend itself:
    tests/test_export.py)."""
    folder = model_folder(tmp_path, tokenizer_folder, architecture)
    sweep = ("eval.lengths=[32,128]", "eval.variants=[self_extend]", "eval.max_windows=8", f"precision={precision}")
    evaluate_hf(compose_hf(tmp_path, small_text_corpus, folder, *sweep))
    rows = json.loads((tmp_path / "out" / "results.json").read_text())["rows"]
    by = {(r["variant"], r["length"]): r for r in rows}
    assert by["self_extend", 32]["variant_factor"] == 1.0 and by["self_extend", 128]["variant_factor"] > 1
    within = 1e-6 if precision == "32-true" else 1e-2
    assert by["self_extend", 32]["mean_nll"] == pytest.approx(by[None, 32]["mean_nll"], rel=within)
    assert by["self_extend", 128]["mean_nll"] != pytest.approx(by[None, 128]["mean_nll"], rel=1e-4)


def test_the_long_context_protocols_evaluate_a_hugging_face_model(tmp_path, small_text_corpus, tokenizer_folder):
    """Key-token perplexity and haystack retrieval run on an HF model as on lenext's: rows of both, the answers'
    greedy tokens from its own logits."""
    folder = model_folder(tmp_path, tokenizer_folder, "llama")
    overrides = ("eval.lengths=[32,256]", "eval.protocol=[key_tokens,niah_single]", "eval.haystack_samples=1")
    evaluate_hf(compose_hf(tmp_path, small_text_corpus, folder, *overrides, "eval.max_windows=4"))
    rows = json.loads((tmp_path / "out" / "results.json").read_text())["rows"]
    ok = {(r["protocol"], r["length"]) for r in rows if r["status"] == "ok" and r.get("depth") is None}
    assert ("key_tokens", 256) in ok and ("niah_single", 256) in ok
    retrieval = next(r for r in rows if r["protocol"] == "niah_single" and r["length"] == 256 and "depth" not in r)
    assert retrieval["answers"] == retrieval["windows"] == 5 and 0 <= retrieval["rank_accuracy"] <= 1  # one a depth


def test_a_position_table_that_is_no_learned_embedding_also_bounds_the_lengths():
    """GPT-J's and CodeGen's sin/cos buffer of n_positions rows and MPT's ALiBi built to max_seq_len: beyond them
    the forward raised an IndexError or a shape error, losing the sweep; now those lengths are n/a, as GPT-2's."""
    import transformers

    from lenext.errors import LengthNotSupported
    from lenext.hf import HFLanguageModel, position_limit

    small = {"vocab_size": VOCAB, "bos_token_id": 0, "eos_token_id": 0}
    configs = {
        "gptj": transformers.GPTJConfig(n_embd=32, n_layer=1, n_head=4, n_positions=CONTEXT, rotary_dim=4, **small),
        "codegen": transformers.CodeGenConfig(
            n_embd=32, n_layer=1, n_head=4, n_positions=CONTEXT, rotary_dim=4, **small
        ),
        "mpt": transformers.MptConfig(d_model=32, n_layers=1, n_heads=4, max_seq_len=CONTEXT, **small),
    }
    for name, config in configs.items():
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        assert position_limit(model) == CONTEXT, name
        wrapped = HFLanguageModel(model, context=CONTEXT)
        tokens = torch.randint(0, VOCAB, (1, CONTEXT + 1))
        assert wrapped.token_nll(tokens[:, :-1], tokens[:, 1:]).shape == (1, CONTEXT)
        with pytest.raises(LengthNotSupported, match=f"its position table serves at most {CONTEXT} tokens"):
            wrapped.token_nll(
                torch.zeros(1, 2 * CONTEXT, dtype=torch.long), torch.zeros(1, 2 * CONTEXT, dtype=torch.long)
            )
    llama = transformers.AutoModelForCausalLM.from_config(tiny_config("llama"))
    assert position_limit(llama) is None  # RoPE: any length
