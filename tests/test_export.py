"""lenext-export: every PE's export gives lenext's logits at L_train and 8 x L_train (its own code, or a native
transformers architecture where one computes the same), generates what lenext generates, and evaluates back to the
checkpoint's results (docs/export.md)."""

import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from transformers.utils import logging as transformers_logging

from lenext.build import build_net
from lenext.errors import CheckpointError, ConfigError
from lenext.export import export, main
from lenext.hf import evaluate_hf, trained_context
from lenext.run import evaluate_checkpoint
from lenext.run_folder import resolve_training
from tests.conftest import CONFIG_FOLDER, needs_transformers_models, small_corpus_overrides
from tests.test_evaluate import compose_eval

pytestmark = needs_transformers_models  # the HF bridge, which lenext refuses where transformers runs no model

PES = sorted(path.stem for path in (CONFIG_FOLDER / "pe").glob("*.yaml"))
TRAIN_LEN = 32


def relative_error(theirs: torch.Tensor, ours: torch.Tensor) -> float:
    return float((theirs.float() - ours.float()).norm() / ours.float().norm())


@pytest.fixture
def make_checkpoint(tmp_path, compose_train, small_text_corpus):
    """make_checkpoint(*overrides) -> (checkpoint path, its net): a tiny run's model with every weight moved off
    its initial value (a LayerNorm bias of 0 would hide a bias written to the wrong place), saved as a run saves."""

    def make(*overrides):
        cfg = compose_train(*small_corpus_overrides(small_text_corpus, *overrides))
        spec, _ = resolve_training(cfg)
        torch.manual_seed(0)
        net = build_net(spec, 512)
        with torch.no_grad():
            for parameter in net.parameters():
                parameter.add_(torch.randn_like(parameter) * 0.2)
            net.pe.project_()  # back into the PE's domain (KERPLE's r1, r2 >= 0.01), as after a training step
        path = tmp_path / f"{len(list(tmp_path.glob('*.ckpt')))}.ckpt"
        state = {f"net.{k}": v for k, v in net.state_dict().items()}
        torch.save({"hyper_parameters": {"run": spec.stored()}, "state_dict": state, "global_step": 1}, path)
        return str(path), net.eval()

    return make


def load(folder, remote: bool):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=remote, dtype=torch.float32).eval()


@torch.no_grad()
def logit_errors(net, model, lengths=(TRAIN_LEN, 8 * TRAIN_LEN)) -> list[float]:
    errors = []
    for length in lengths:
        tokens = torch.randint(net.vocab_size, (2, length), generator=torch.Generator().manual_seed(length))
        errors.append(relative_error(model(input_ids=tokens, use_cache=False).logits, net.logits(net(tokens))))
    return errors


@pytest.mark.parametrize("pe", PES)
def test_every_pe_exports_with_its_own_code_and_gives_lenexts_logits(pe, tmp_path, make_checkpoint, cache_dir):
    checkpoint, net = make_checkpoint(f"pe={pe}")
    folder = tmp_path / "exported"
    assert export(checkpoint, str(folder), "remote", cache_dir=cache_dir)[0] == "remote"
    model = load(folder, remote=True)
    assert model.config.lenext_context == TRAIN_LEN == trained_context(model.config)  # as a native export says
    if pe == "learned":  # its table ends at L_train: beyond it lenext's n/a, raised by the exported model too
        assert logit_errors(net, model, (TRAIN_LEN,)) == [0.0]
        with pytest.raises(Exception, match="learned positional embeddings exist for positions 0..31"):
            logit_errors(net, model, (2 * TRAIN_LEN,))
        assert model.config.position_limit == TRAIN_LEN
    else:
        assert logit_errors(net, model) == [0.0, 0.0]  # lenext's own code: the same operations, bit for bit
    # No line of the folder's code imports lenext: transformers needs nothing but the folder.
    for file in folder.glob("*.py"):
        assert not re.search(r"^\s*(from|import) lenext\b", file.read_text(), flags=re.MULTILINE), file.name


@pytest.mark.parametrize("pe", ["learned", "xpos"])
def test_a_pe_that_serves_few_positions_exports_its_limit_and_hf_evaluation_refuses_beyond_it(
    pe, tmp_path, make_checkpoint, cache_dir
):
    """Beyond the positions a PE serves, lenext's forward raises LengthNotSupported (an n/a row); the export keeps
    the limit, so eval.py hf= says n/a at the same lengths (xPos's code in the folder raised its own copy of the
    error, which the sweep did not know, and ended the evaluation)."""
    from lenext.errors import LengthNotSupported
    from lenext.hf import HFLanguageModel, load_model

    checkpoint, net = make_checkpoint(f"pe={pe}", *(["pe.scale_base=4"] if pe == "xpos" else []))
    limit = {"learned": TRAIN_LEN, "xpos": 255}[pe]  # xPos: 2 x 4 x 40 / ln(3.5) positions at gamma 4
    assert net.pe.position_limit == limit
    export(checkpoint, str(tmp_path / "exported"), "remote", cache_dir=cache_dir)
    model = HFLanguageModel(load_model(str(tmp_path / "exported"), trust_remote_code=True))
    tokens = torch.randint(net.vocab_size, (1, limit + 1), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(
        model.token_nll(tokens[:, :-1], tokens[:, 1:]), net.token_nll(tokens[:, :-1], tokens[:, 1:])
    )
    with pytest.raises(LengthNotSupported, match=f"serves at most {limit} tokens"):
        model.token_nll(tokens, tokens)


NATIVE_CASES = {
    # overrides: the architecture auto picks, and the rope_type its config names
    "rope": (("pe=rope",), "gpt_neox", "default"),
    "rope_llama": (("pe=rope", "model=llama"), "llama", "default"),
    "rope_tied": (("pe=rope", "model.tie_embeddings=true"), "gpt_neox", "default"),
    "linear": (("pe=rope", "pe.scaling=linear", "pe.factor=4"), "gpt_neox", "linear"),
    "ntk": (("pe=rope", "pe.scaling=ntk", "pe.factor=4"), "gpt_neox", "default"),
    "yarn": (("pe=rope", "pe.scaling=yarn", "pe.factor=8", "model=llama"), "llama", "yarn"),
    # trained at 32 under YaRN from an original context of 16: eval.py hf= multiplies 32, as the checkpoint's sweep
    "yarn_from_16": (
        ("pe=rope", "pe.scaling=yarn", "pe.factor=4", "pe.original_len=16", "model=llama"),
        "llama",
        "yarn",
    ),
    "llama3": (("pe=rope", "pe.scaling=llama3", "pe.factor=8", "model=llama"), "llama", "llama3"),
    "randomized": (("pe=rope_randomized",), "gpt_neox", "default"),  # positions drawn up to 1024 in training
    "learned": (("pe=learned",), "gpt2", None),
}


@pytest.mark.parametrize("case", NATIVE_CASES)
def test_a_model_transformers_computes_exports_natively_within_1e5(case, tmp_path, make_checkpoint, cache_dir):
    overrides, architecture, rope_type = NATIVE_CASES[case]
    checkpoint, net = make_checkpoint(*overrides)
    folder = tmp_path / "exported"
    assert export(checkpoint, str(folder), cache_dir=cache_dir)[0] == architecture
    assert not list(folder.glob("*.py"))  # transformers' own code: nothing to trust
    model = load(folder, remote=False)
    if rope_type:
        assert model.config.rope_parameters["rope_type"] == rope_type
        assert model.config.max_position_embeddings == TRAIN_LEN  # the context eval.factors multiply, as lenext's
    assert trained_context(model.config) == TRAIN_LEN  # eval.py hf= multiplies it too (YaRN's original may differ)
    lengths = (TRAIN_LEN,) if architecture == "gpt2" else (TRAIN_LEN, 8 * TRAIN_LEN)
    assert max(logit_errors(net, model, lengths)) < 1e-5


@torch.no_grad()
def greedy(net, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    """lenext's greedy continuation: the most likely next token, appended, the whole sequence scored again."""
    tokens = prompt
    for _ in range(steps):
        tokens = torch.cat([tokens, net.logits(net(tokens))[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokens


@pytest.mark.parametrize("pe", PES)
def test_the_exported_models_generate_continues_as_lenext_does(pe, tmp_path, make_checkpoint, cache_dir):
    """Every PE, natively where it goes out natively (RoPE, learned), else by remote code: greedy ``generate``
    (transformers' cache where the architecture has one) is lenext's greedy continuation, token for token, to
    L_train (the learned table's end)."""
    checkpoint, net = make_checkpoint(f"pe={pe}")
    chosen = export(checkpoint, str(tmp_path / "exported"), cache_dir=cache_dir)[0]
    model = load(tmp_path / "exported", remote=chosen == "remote")
    prompt = torch.randint(net.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    # Generation stops at the tokenizer's end of text (id 0 of lenext's BPE), not at transformers' default ids.
    assert model.config.eos_token_id == model.generation_config.eos_token_id == 0
    steps = TRAIN_LEN - prompt.size(1)
    generated = model.generate(prompt, max_new_tokens=steps, do_sample=False, pad_token_id=0)
    expected = greedy(net, prompt, steps)
    assert torch.equal(generated, expected[:, : generated.size(1)])
    assert generated.size(1) == expected.size(1) or generated[0, -1] == 0  # only an end of text stops it early


def test_the_exported_tokenizer_puts_the_start_token_before_text_as_lenexts_documents_have_it(
    tmp_path, make_checkpoint, cache_dir
):
    """The harness and generate() encode with transformers' defaults: the text then follows the token every lenext
    document starts with (id 0, `<|endoftext|>`), and lenext's own encoding (no special tokens) is unchanged."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    checkpoint, _ = make_checkpoint("pe=rope")
    folder = tmp_path / "exported"
    export(checkpoint, str(folder), cache_dir=cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = "The state of the Union is strong. ünïcödé, 中文"
    own = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    assert tokenizer.bos_token_id == 0 and tokenizer.convert_ids_to_tokens(0) == "<|endoftext|>"
    assert tokenizer(text)["input_ids"] == [0, *own] and tokenizer(text, add_special_tokens=False)["input_ids"] == own
    assert tokenizer.decode(tokenizer(text)["input_ids"], skip_special_tokens=True) == text


@pytest.mark.parametrize(
    "pe,architecture", [("rope", "gpt_neox"), ("rope", "remote"), ("t5", "auto"), ("learned", "remote")]
)
def test_the_export_evaluates_back_to_the_checkpoints_results(
    pe, architecture, tmp_path, make_checkpoint, cache_dir, small_text_corpus
):
    checkpoint, _ = make_checkpoint(f"pe={pe}")
    folder = tmp_path / "exported"
    remote = export(checkpoint, str(folder), architecture, cache_dir=cache_dir)[0] == "remote"
    sweep = ("eval.lengths=[32,96]", "eval.protocol=[nonoverlap,sliding,last_k]", "eval.last_k=8", "eval.stride=16")
    sweep = (*sweep, "eval.max_windows=16")  # the same windows in both: their rows compared one by one
    evaluate_checkpoint(compose_eval(tmp_path, tmp_path / "ckpt", checkpoint, *sweep))
    data = ("data=text_files", f"data.corpus.path={small_text_corpus}", "data.corpus.holdout_every=4")
    trust = (f"trust_remote_code={str(remote).lower()}",)
    if remote:  # untrusted: lenext's one line, without transformers' notice on the folder's config before it
        said, notices = [], logging.Handler()
        notices.emit = said.append
        transformers_logging.get_logger().addHandler(notices)
        try:
            with pytest.raises(ConfigError, match=r"its model's code is not in transformers but in the folder"):
                evaluate_hf(compose_eval(tmp_path, tmp_path / "untrusted", "null", f"hf={folder}", *data, *sweep))
        finally:
            transformers_logging.get_logger().removeHandler(notices)
        assert not said, said[0].getMessage()
    evaluate_hf(compose_eval(tmp_path, tmp_path / "hf", "null", f"hf={folder}", *data, *trust, *sweep))
    ours, theirs = (json.loads((tmp_path / run / "results.json").read_text()) for run in ("ckpt", "hf"))
    assert [(r["protocol"], r["length"]) for r in ours["rows"]] == [
        (r["protocol"], r["length"]) for r in theirs["rows"]
    ]
    assert any(row["status"] != "ok" for row in theirs["rows"]) == (pe == "learned")  # 96 > its table's 32
    for mine, exported in zip(ours["rows"], theirs["rows"], strict=True):
        assert (mine["tokens"], mine["windows"], mine["status"]) == (
            exported["tokens"],
            exported["windows"],
            exported["status"],
        )
        if mine["status"] != "ok":  # learned positions beyond their table: n/a in both
            continue
        if architecture != "gpt_neox":  # lenext's own code: the printed digits (native: its rotary's rounding)
            assert f"{mine['ppl']:.3f}" == f"{exported['ppl']:.3f}"
        assert exported["mean_nll"] == pytest.approx(mine["mean_nll"], rel=1e-6)
        assert exported["bits_per_byte"] == pytest.approx(mine["bits_per_byte"], rel=1e-6)


def test_a_model_without_lenext_installed_loads_and_runs(tmp_path, make_checkpoint, cache_dir):
    """Nor Triton and fla (the GPU kernels' packages, optional): transformers refuses remote code whose files import
    a package that is missing, unless in a try block."""
    checkpoint, net = make_checkpoint("pe=fire")
    export(checkpoint, str(tmp_path / "exported"), cache_dir=cache_dir)
    tokens = torch.randint(net.vocab_size, (1, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = net.logits(net(tokens))[0, -1].argmax().item()
    script = (
        "import sys; sys.modules.update(lenext=None, triton=None, fla=None)\n"  # as where they are not installed
        "import torch\nfrom transformers import AutoModelForCausalLM\n"
        f"model = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'exported')!r}, trust_remote_code=True)\n"
        f"tokens = torch.tensor([{tokens[0].tolist()}])\n"
        "print(model(input_ids=tokens).logits[0, -1].argmax().item())\n"
    )
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "PYTHONPATH": ""}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) == expected


def test_bad_input_is_refused_in_one_line_and_nothing_is_written(
    tmp_path, make_checkpoint, cache_dir, capsys, monkeypatch
):
    checkpoint, _ = make_checkpoint("pe=rope")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"taken exists and is not an empty folder: give a new folder, or --force"):
        export(checkpoint, str(taken), cache_dir=cache_dir)
    assert [p.name for p in taken.iterdir()] == ["notes.txt"]
    assert export(checkpoint, str(taken), force=True, cache_dir=cache_dir)[0] == "gpt_neox"
    assert not (taken / "notes.txt").exists() and (taken / "config.json").exists()
    a_file = tmp_path / "results.txt"  # --force replaced a file by a folder (an audit found it deleted)
    a_file.write_text("mine")
    with pytest.raises(ConfigError, match=r"results.txt is a file, not a folder: give a folder path$"):
        export(checkpoint, str(a_file), force=True, cache_dir=cache_dir)
    assert a_file.read_text() == "mine"
    run = tmp_path / "a_run"  # another run's folder: --force deleted its checkpoints (an audit found it)
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_text("weights")
    with pytest.raises(ConfigError, match=r"a_run holds a lenext run.s checkpoints/last.ckpt: --force replaces an ex"):
        export(checkpoint, str(run), force=True, cache_dir=cache_dir)
    assert (run / "checkpoints" / "last.ckpt").read_text() == "weights"
    shutil.rmtree(run)
    with pytest.raises(ConfigError, match=r"^the export's folder is '' \(an unset variable\?\)"):
        export(checkpoint, "", cache_dir=cache_dir)
    with pytest.raises(ConfigError, match=r"^--cache-dir .*results.txt cannot be the data cache \(.*is not a folder"):
        export(checkpoint, str(tmp_path / "e"), cache_dir=str(a_file))  # a traceback from deep in the data code
    with pytest.raises(ConfigError, match=r"^--architecture llama is invalid for this checkpoint: its blocks use "):
        export(checkpoint, str(tmp_path / "a"), "llama", cache_dir=cache_dir)
    with pytest.raises(ConfigError, match=r"^--architecture 'bloom' is invalid: it must be one of auto, remote, "):
        export(checkpoint, str(tmp_path / "b"), "bloom", cache_dir=cache_dir)
    dynamic, _ = make_checkpoint("pe=rope", "pe.scaling=dynamic_ntk")  # transformers keeps the longest length's base
    with pytest.raises(ConfigError, match=r"^--architecture gpt_neox is invalid for this checkpoint: pe.scaling=dyn"):
        export(dynamic, str(tmp_path / "f"), "gpt_neox", cache_dir=cache_dir)
    alibi, _ = make_checkpoint("pe=alibi")
    with pytest.raises(ConfigError, match=r"^--architecture gpt_neox is invalid for this checkpoint: its PE is ALiBi"):
        export(alibi, str(tmp_path / "c"), "gpt_neox", cache_dir=cache_dir)
    with pytest.raises(CheckpointError, match=r"does not exist"):
        export(str(tmp_path / "missing.ckpt"), str(tmp_path / "d"), cache_dir=cache_dir)
    foreign = tmp_path / "foreign.ckpt"
    torch.save({"state_dict": {}}, foreign)
    with pytest.raises(CheckpointError, match=r"is not a lenext checkpoint"):
        export(str(foreign), str(tmp_path / "e"), cache_dir=cache_dir)
    # Folders whose writing would fail late or lose something: refused before any work.
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ConfigError, match=r"a_file/sub is inside .*a_file, which is a file: give a folder path$"):
        export(checkpoint, str(tmp_path / "a_file" / "sub"), cache_dir=cache_dir)
    read_only = tmp_path / "read_only"  # a read-only disk: os.access says so, for root too (root may chmod-write)
    read_only.mkdir()
    with monkeypatch.context() as patched:
        patched.setattr(os, "access", lambda path, mode: os.fspath(path) != str(read_only))
        with pytest.raises(ConfigError, match=r"read_only/out cannot be written: .*read_only is not writable; give a"):
            export(checkpoint, str(read_only / "out"), cache_dir=cache_dir)  # a traceback after loading the model
    assert os.listdir(read_only) == []
    read_only.rmdir()
    (tmp_path / "link").symlink_to(taken)
    with pytest.raises(ConfigError, match=r"link is a symbolic link: give the folder itself, or a new folder$"):
        export(checkpoint, str(tmp_path / "link"), force=True, cache_dir=cache_dir)
    with pytest.raises(
        ConfigError, match=r"holds the checkpoint .*: writing there would replace it; give a new folder"
    ):
        export(checkpoint, str(tmp_path), force=True, cache_dir=cache_dir)
    monkeypatch.chdir(taken)
    with pytest.raises(ConfigError, match=r"^\. is the folder this command runs in, or holds it: give a new folder$"):
        export(checkpoint, ".", force=True, cache_dir=cache_dir)
    leftovers = sorted(p.name for p in tmp_path.iterdir() if not p.suffix and p.name not in ("a_file", "link"))
    assert leftovers == ["taken"] and (tmp_path / "taken" / "config.json").exists()  # no folder, no leftover
    # The command line: one line on stderr, a non-zero exit.
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main([checkpoint, str(taken), "--cache-dir", cache_dir])
    assert exited.value.code != 0
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: ") and "\n" not in error


def test_sigterm_while_lenext_export_writes_leaves_nothing_and_says_so(
    tmp_path, make_checkpoint, cache_dir, capsys, monkeypatch
):
    """A SIGTERM (scancel, a machine going away) mid-export: one line, status 143, and neither the folder nor the
    folder written aside for it (the default action of SIGTERM kept the latter, half-written)."""
    import signal

    import lenext.export

    checkpoint, _ = make_checkpoint("pe=alibi")
    written = lenext.export.write_remote

    def write_then_stop(*args):
        written(*args)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(lenext.export, "write_remote", write_then_stop)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exited:
        main([checkpoint, str(tmp_path / "exported"), "--cache-dir", cache_dir])
    assert exited.value.code == 143 and signal.getsignal(signal.SIGTERM) == before
    assert capsys.readouterr().err.strip() == (
        "error: stopped by SIGTERM; every file written so far is whole: run the same command to go on"
    )
    assert [p.name for p in tmp_path.iterdir() if "exported" in p.name] == []


@pytest.mark.slow
def test_lm_evaluation_harness_scores_an_export_as_lenext_does(tmp_path, make_checkpoint, cache_dir, small_text_corpus):
    """`lm_eval --model hf` on a task from a local file: its perplexity of each continuation is lenext's."""
    from transformers import AutoTokenizer

    checkpoint, net = make_checkpoint("pe=alibi")  # remote code: the harness runs lenext's own modules
    folder = tmp_path / "exported"
    export(checkpoint, str(folder), cache_dir=cache_dir)
    # One line each: the harness's templates drop a trailing newline.
    texts = [" ".join(path.read_text()[:400].split()) for path in sorted(small_text_corpus.glob("*.txt"))[:6]]
    contexts = [text[:200].rstrip() for text in texts]  # the harness moves a context's trailing spaces on
    docs = [{"context": c, "continuation": text[len(c) : 260]} for c, text in zip(contexts, texts, strict=True)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "local.yaml").write_text(
        "task: lenext_local\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {tmp_path / 'docs.jsonl'}\n"
        "test_split: test\noutput_type: loglikelihood\ntarget_delimiter: ''\n"
        'doc_to_text: "{{context}}"\ndoc_to_target: "{{continuation}}"\n'
        "metric_list:\n  - metric: perplexity\n    aggregation: perplexity\n    higher_is_better: false\n"
    )
    # max_length: the harness would cut each input to the config's max_position_embeddings (L_train) otherwise.
    model_args = f"pretrained={folder},trust_remote_code=True,dtype=float32,max_length=512"
    command = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", model_args, "--tasks", "lenext_local"]
    command += ["--include_path", str(tmp_path / "tasks"), "--device", "cpu", "--batch_size", "1"]
    command += ["--output_path", str(tmp_path / "harness")]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (results,) = tmp_path.glob("harness/**/results_*.json")
    perplexity = json.loads(results.read_text())["results"]["lenext_local"]["perplexity,none"]
    # lenext's: the harness's tokens (the context's own, then those of context + continuation after as many), the
    # continuation's scored by the net.
    tokenizer = AutoTokenizer.from_pretrained(folder)
    log_likelihoods = []
    for doc in docs:
        context = tokenizer(doc["context"])["input_ids"]
        assert context[0] == 0  # the start token every lenext document begins with, as the harness encodes it
        tokens = context + tokenizer(doc["context"] + doc["continuation"])["input_ids"][len(context) :]
        with torch.no_grad():
            logits = net.logits(net(torch.tensor([tokens[:-1]])))[0].double()
        scored = torch.log_softmax(logits, dim=-1)[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])]
        log_likelihoods.append(scored[len(context) - 1 :].sum().item())
    assert math.log(perplexity) == pytest.approx(-sum(log_likelihoods) / len(docs), rel=1e-6)


def test_self_extend_on_a_hugging_face_model_is_lenexts(tmp_path, make_checkpoint, cache_dir, small_text_corpus):
    """eval.variants=[self_extend] on a Llama export (transformers' code, patched through its attention interface)
    gives the rows lenext's Self-Extend gives on the checkpoint: the same group sizes, the same NLL."""
    checkpoint, _ = make_checkpoint("pe=rope", "model=llama")
    folder = tmp_path / "exported"
    assert export(checkpoint, str(folder), cache_dir=cache_dir)[0] == "llama"
    sweep = (
        "eval.lengths=[32,100,256]",
        "eval.protocol=[nonoverlap,last_k]",
        "eval.last_k=8",
        "eval.variants=[self_extend]",
        "eval.max_windows=8",
    )
    evaluate_checkpoint(compose_eval(tmp_path, tmp_path / "ckpt", checkpoint, *sweep))
    data = ("data=text_files", f"data.corpus.path={small_text_corpus}", "data.corpus.holdout_every=4")
    evaluate_hf(compose_eval(tmp_path, tmp_path / "hf", "null", f"hf={folder}", *data, *sweep))
    ours, theirs = (json.loads((tmp_path / run / "results.json").read_text())["rows"] for run in ("ckpt", "hf"))
    extended = [row for row in theirs if row["variant"] == "self_extend"]
    assert [(r["protocol"], r["length"], r["variant_factor"]) for r in ours] == [
        (r["protocol"], r["length"], r["variant_factor"]) for r in extended
    ]
    assert [r["variant_factor"] for r in extended if r["protocol"] == "nonoverlap"] == [1.0, 4.0, 11.0]
    for mine, exported in zip(ours, extended, strict=True):
        assert exported["mean_nll"] == pytest.approx(mine["mean_nll"], rel=1e-6)
    plain = {r["length"]: r["mean_nll"] for r in theirs if r["variant"] is None and r["protocol"] == "nonoverlap"}
    assert extended[2]["mean_nll"] != pytest.approx(plain[256], rel=1e-3)  # grouping changed the scores beyond C


@pytest.mark.parametrize("architecture", ["gpt_neox", "llama"])
def test_an_export_of_rope_at_randomized_positions_scales_from_the_span_it_trained(
    architecture, tmp_path, make_checkpoint, cache_dir, small_text_corpus
):
    """A zero-shot scaling extends from the span of positions a RoPE trained (RoPE.variant): N under randomized
    positions, 1,024 here, not L_train, 32. Its export keeps that C, so eval.py hf= scales nothing at 96 tokens,
    as lenext does (it scaled from 32, by 3, and called the rows yarn's and pi's)."""
    checkpoint, net = make_checkpoint("pe=rope_randomized", *(["model=llama"] if architecture == "llama" else []))
    span = net.pe.shape.trained_positions
    assert span > 96
    folder = tmp_path / "exported"
    assert export(checkpoint, str(folder), architecture, cache_dir=cache_dir)[0] == architecture
    sweep = ("eval.lengths=[32,96]", "eval.protocol=nonoverlap", "eval.variants=[yarn,linear]", "eval.max_windows=8")
    evaluate_checkpoint(compose_eval(tmp_path, tmp_path / "ckpt", checkpoint, *sweep, "eval.positions=sequential"))
    data = ("data=text_files", f"data.corpus.path={small_text_corpus}", "data.corpus.holdout_every=4")
    evaluate_hf(compose_eval(tmp_path, tmp_path / "hf", "null", f"hf={folder}", *data, *sweep))
    ours, theirs = (json.loads((tmp_path / run / "results.json").read_text())["rows"] for run in ("ckpt", "hf"))
    as_trained = {r["length"]: r["mean_nll"] for r in ours}
    assert json.loads((folder / "config.json").read_text())["lenext_scaling_context"] == span
    for row in theirs:
        assert row["mean_nll"] == pytest.approx(as_trained[row["length"]], rel=1e-6), row
        assert row["variant"] is None or row["variant_factor"] == 1.0, row


def test_a_native_export_of_a_long_trained_llama_passes_its_check(tmp_path, make_checkpoint, cache_dir):
    """The export's check of its logits runs on at most CHECK_LENGTH tokens, within TOLERANCE: at L_train 2,048,
    transformers' fp32 RoPE angles put model=llama's logits over 1e-5 from lenext's (fp64 angles), which the check,
    then at L_train within 1e-5, refused as a bug."""
    checkpoint, net = make_checkpoint("pe=rope", "model=llama", "data.max_len=2048")
    chosen, error, _ = export(checkpoint, str(tmp_path / "exported"), cache_dir=cache_dir)
    assert chosen == "llama" and error < 1e-5
    assert logit_errors(net, load(tmp_path / "exported", remote=False), (2048,))[0] > 1e-5  # fp32 angles


def test_an_export_whose_code_cannot_run_is_refused_in_one_line(tmp_path, make_checkpoint, cache_dir):
    """A remote-code folder whose code imports a package not installed, does not parse, or lacks one of its files:
    one line saying the folder's code could not be run (a traceback before, or the weights blamed)."""
    from lenext.hf import load_model

    checkpoint, _ = make_checkpoint("pe=t5")
    export(checkpoint, str(tmp_path / "exported"), "remote", cache_dir=cache_dir)
    files = {path.name: path.read_text() for path in (tmp_path / "exported").glob("*.py")}
    breakages = {
        "import not_a_package_here\n": r"ImportError: .*not_a_package_here",
        "def broken(:\n": r"SyntaxError: ",
        None: r"(OSError|FileNotFoundError|ImportError): .*lenext_pe_bias",
    }
    for number, (line, message) in enumerate(breakages.items()):
        folder = tmp_path / f"broken{number}"  # transformers caches a folder's code by its name: one per case
        shutil.copytree(tmp_path / "exported", folder)
        if line is None:
            (folder / "lenext_pe_bias.py").unlink()
        else:
            (folder / "modeling_lenext.py").write_text(line + files["modeling_lenext.py"])
        with pytest.raises(ConfigError) as refused:
            load_model(str(folder), trust_remote_code=True)
        text = str(refused.value)
        assert (
            text.startswith(f"hf={str(folder)!r}: the model's code in the folder could not be run (")
            and "\n" not in text
        )
        assert re.search(message, text), text


def test_hf_names_a_folder_under_home_and_a_hub_id_it_cannot_reach_in_one_line(tmp_path, monkeypatch):
    from lenext.hf import hf_folder

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    assert hf_folder("~/model") == str(tmp_path / "model")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError) as refused:
        hf_folder("exported/no_such_model")
    assert "\n" not in str(refused.value) and str(refused.value).startswith("hf='exported/no_such_model' is neither")
