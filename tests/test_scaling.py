"""How a net runs at scale, none of which changes what it computes: activation checkpointing per block (every PE),
a sharded (FSDP2) step on two ranks, trainer=fsdp's configuration; module.compile refused on a CPU (measured per PE:
scripts/compile_check.py). A whole trainer=fsdp_sim run: tests/test_study.py (slow)."""

import socket

import pytest
import torch
import torch.multiprocessing as mp
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

import lenext.cli  # noqa: F401 (registers the config resolvers)
from lenext.build import build_net
from lenext.model import Decoder
from lenext.module import LanguageModel, shard
from lenext.pe import FIRE, KERPLE, RoPE, T5Bias
from lenext.run_folder import resolve_training
from tests import forked
from tests.conftest import CONFIG_FOLDER, needs_compiled_paths_torch, tiny_overrides

PES = sorted(path.stem for path in (CONFIG_FOLDER / "pe").glob("*.yaml"))


def tiny_module(compose_train, pe: str, *overrides: str, **switches) -> LanguageModel:
    spec, _ = resolve_training(compose_train(*tiny_overrides(f"pe={pe}", "data.max_len=16", *overrides)))
    torch.manual_seed(0)
    module = LanguageModel(build_net(spec, 64), **switches)
    module.configure_model()
    return module


def loss_and_gradients(module: LanguageModel, precision: str) -> tuple[torch.Tensor, dict]:
    tokens = torch.randint(64, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        hidden = module.net(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            module.net.logits(hidden).flatten(0, 1).float(), tokens[:, 1:].flatten()
        )
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in module.net.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("pe", PES)
def test_activation_checkpointing_gives_every_pes_loss_and_gradients(pe, precision, compose_train):
    plain = loss_and_gradients(tiny_module(compose_train, pe), precision)
    recomputed = loss_and_gradients(tiny_module(compose_train, pe, activation_checkpointing=True), precision)
    assert recomputed[0] == plain[0]
    assert recomputed[1].keys() == plain[1].keys() and plain[1]
    for name, gradient in plain[1].items():
        torch.testing.assert_close(recomputed[1][name], gradient, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("pe", ["rope", "xpos", "alibi"])
@needs_compiled_paths_torch
def test_compiled_blocks_under_activation_checkpointing_give_eager_gradients(pe, compose_train, monkeypatch):
    """The backward recomputes a checkpointed block outside the decoder's forward: RoPE's compiled block then
    traced without the forward's span, saved other tensors and failed ("A different number of tensors was saved";
    found by an audit). Compiled by dynamo's aot_eager backend, the graphs inductor would get."""
    import functools

    import torch._dynamo

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    plain = loss_and_gradients(tiny_module(compose_train, pe), "fp32")
    torch._dynamo.reset()
    both = tiny_module(compose_train, pe, activation_checkpointing=True, compile=True)
    recomputed = loss_and_gradients(both, "fp32")
    assert both.net.compiled_blocks is not None
    torch.testing.assert_close(recomputed[0], plain[0], rtol=1e-6, atol=0)
    for name, gradient in plain[1].items():
        torch.testing.assert_close(recomputed[1][name], gradient, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("pe", ["alibi", "kerple"])
@needs_compiled_paths_torch
def test_every_block_of_a_deep_model_runs_compiled(pe, compose_train, monkeypatch):
    """A PE reading its layer's index compiles a graph per block; dynamo stopped at 8 graphs of the blocks' shared
    code and ran the rest eager, with a warning (4 of llama_125m's 12 blocks; found by an audit)."""
    import functools

    import torch._dynamo
    from torch._dynamo.utils import counters

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    with config.patch({name: getattr(config, name)}):  # compile_blocks raises it: restored after the test
        module = tiny_module(compose_train, pe, "model.n_layers=12", compile=True)
        torch._dynamo.reset()
        counters.clear()
        tokens = torch.randint(64, (2, 17), generator=torch.Generator().manual_seed(1))
        module.net.token_nll(tokens[:, :-1], tokens[:, 1:]).mean().backward()
    assert not counters["stats"].get("recompile_limit_hit") and not counters["stats"].get("cache_size_limit_hit")
    assert counters["stats"]["unique_graphs"] >= 12


def test_activation_checkpointing_is_a_switch_that_adds_no_state(compose_train):
    module = tiny_module(compose_train, "rope", activation_checkpointing=True)
    assert module.net.checkpoint_blocks
    assert set(module.net.state_dict()) == set(tiny_module(compose_train, "rope").net.state_dict())


@pytest.mark.parametrize(
    "devices, gpus, expected",
    [("8", 0, 32), ("auto", 8, 32), ("-1", 2, 8), ("[0,1,2]", 0, 12), ("'0,1'", 0, 8)],
)
def test_fsdp_shards_across_every_device_of_every_node(devices, gpus, expected, monkeypatch):
    """Every form of trainer.devices Lightning takes (a count, auto and -1: every GPU, indices) times 4 nodes."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    with initialize_config_module(config_module="lenext.configs", version_base="1.3"):
        cfg = compose("train", overrides=["trainer=fsdp", f"trainer.devices={devices}", "trainer.num_nodes=4"])
    strategy = OmegaConf.to_container(cfg.trainer.strategy, resolve=True)
    assert strategy["data_parallel_size"] == expected and strategy["tensor_parallel_size"] == 1
    assert strategy["save_distributed_checkpoint"] is False  # last.ckpt: one file, read as any run's


def test_fsdp_on_every_gpu_of_a_machine_without_one_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with initialize_config_module(config_module="lenext.configs", version_base="1.3"):
        cfg = compose("train", overrides=["trainer=fsdp", "trainer.devices=auto"])
    with pytest.raises(Exception, match="trainer.devices=auto is invalid here: it counts the node's CUDA GPUs"):
        OmegaConf.to_container(cfg.trainer.strategy, resolve=True)


STEP_PES = {"rope": RoPE, "t5": T5Bias, "fire": FIRE, "kerple": KERPLE}


def _decoder(pe: str) -> Decoder:
    torch.manual_seed(0)
    return Decoder(64, 16, STEP_PES[pe], d_model=32, n_layers=2, n_heads=4)


def _step(net: Decoder, tokens: torch.Tensor) -> dict:
    """One training step's gradients (whole tensors) on ``tokens``, the loss a mean over them."""
    loss = net.token_nll(tokens[:, :-1], tokens[:, 1:]).mean()
    loss.backward()
    return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad) for n, p in net.named_parameters()}


def _sharded_step(rank: int, world: int, port: int, pe: str, out: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    net = _decoder(pe)
    shard(net, init_device_mesh("cpu", (world,)))
    tokens = torch.randint(64, (8, 17), generator=torch.Generator().manual_seed(1))
    gradients = _step(net, tokens[rank * 4 : (rank + 1) * 4])  # this rank's half of the global batch
    if rank == 0:
        torch.save(gradients, out)
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("pe", sorted(STEP_PES))
@needs_compiled_paths_torch
def test_a_sharded_step_on_two_ranks_gives_one_process_gradients(pe, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    arguments = (2, port, pe, str(tmp_path / "sharded.pt"))
    # forked from the tests' forkserver (tests/forked.py), which has imported torch and lenext: spawn starts anew
    forked.ensure_server()
    mp.start_processes(_sharded_step, args=arguments, nprocs=2, join=True, start_method="forkserver")
    sharded = torch.load(tmp_path / "sharded.pt", weights_only=False)
    whole = _step(_decoder(pe), torch.randint(64, (8, 17), generator=torch.Generator().manual_seed(1)))
    assert sharded.keys() == whole.keys()
    for name, gradient in whole.items():
        torch.testing.assert_close(sharded[name], gradient, rtol=1e-5, atol=1e-7, msg=name)


def test_a_fire_checkpoint_with_scalar_parameters_still_loads():
    net = _decoder("fire")
    state = {
        k: (v.reshape(()) if k.endswith((".c", ".threshold_multiplier")) else v) for k, v in net.state_dict().items()
    }
    assert any(v.dim() == 0 for v in state.values())
    again = _decoder("fire")
    again.load_state_dict(state)
    for name, value in net.state_dict().items():
        torch.testing.assert_close(again.state_dict()[name], value)


def test_compile_is_refused_on_a_cpu_before_any_work(tmp_path):
    from tests.conftest import run_train

    done = run_train(tmp_path, *tiny_overrides("module.compile=true"))
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "module.compile=true is invalid on a CPU: torch.compile's CPU backend crashed (SIGSEGV)" in done.stderr
    assert not (tmp_path / ".cache").exists()  # refused before the corpus was read


def test_resuming_a_fire_run_from_before_its_vectors_reshapes_their_adamw_state(compose_train):
    module = tiny_module(compose_train, "fire")
    checkpoint = {
        "optimizer_states": [
            {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.tensor(0.5), "exp_avg_sq": torch.tensor(0.25)}}}
        ]
    }
    module.on_load_checkpoint(checkpoint)
    state = checkpoint["optimizer_states"][0]["state"][0]
    assert state["exp_avg"].shape == state["exp_avg_sq"].shape == (1,) and state["step"].dim() == 0


@pytest.mark.parametrize(
    "pe",
    [
        *("nope", "sinusoidal", "learned", "rope", "p_rope", "rope_ntk", "xpos", "rope_nope", "rnope_swa", "pope"),
        *("fox", "fox_rope", "alibi", "kerple", "cope", "dape", "path", "path_fox"),
    ],
)
@needs_compiled_paths_torch
def test_a_block_traces_as_one_graph(pe, compose_train):
    """What module.compile compiles, a block, traces whole: no graph break (a PE's table span is read once per
    forward by the decoder, not inside a block; attention recording is a plain global; CoPE's and DAPE's logit terms
    are counted with len(), as dynamo cannot take `not` of a tuple of functions). FIRE's query blocks, which read its
    learned threshold per block (the CPU's path, and CUDA's when training past the threshold), and T5's and Shaw's
    band kernel, the CPU's path, are the known exceptions (on CUDA's flex path each traces whole: below;
    docs/scaling.md)."""
    import torch._dynamo

    from lenext.pe.base import SPAN, forward_reads

    net = tiny_module(compose_train, pe).net
    x, positions = torch.randn(2, 16, net.d_model), torch.arange(16)[None]
    torch._dynamo.reset()
    with forward_reads(positions, {SPAN: 16}):
        explained = torch._dynamo.explain(net.blocks[0])(x, positions)
    assert explained.graph_break_count == 0, [str(b.reason).splitlines()[0] for b in explained.break_reasons]


@pytest.mark.parametrize("pe", ["rope", "kerple", "cope"])
@needs_compiled_paths_torch
def test_evaluation_runs_compiled_blocks_as_they_are_so_a_sweep_compiles_nothing_per_length(
    pe, compose_train, monkeypatch
):
    """module.compile=true compiles the blocks for training: a forward with a gradient runs them compiled, with the
    eager NLL; forwards without one (evaluation's, at 6 lengths) compile nothing. Compiled at every length, RoPE's
    and KERPLE's blocks were recompiled per length (a guard on the span) until dynamo's limit of 8, CoPE's too (its
    query blocks unrolled). Counted as dynamo's graphs, compiled by its eager backend (the same graphs)."""
    import functools

    import torch._dynamo
    from torch._dynamo.utils import counters

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    module = tiny_module(compose_train, pe)
    tokens = torch.randint(64, (2, 17), generator=torch.Generator().manual_seed(1))
    eager = module.net.token_nll(tokens[:, :-1], tokens[:, 1:])
    module.net.compile_blocks()
    torch._dynamo.reset()
    counters.clear()
    for length in (16, 32, 64, 128, 256, 512):
        long = torch.randint(64, (1, length + 1), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            module.net.token_nll(long[:, :-1], long[:, 1:])
    assert counters["stats"]["unique_graphs"] == 0
    compiled = module.net.token_nll(tokens[:, :-1], tokens[:, 1:])
    assert counters["stats"]["unique_graphs"] >= 1 and compiled.requires_grad
    torch.testing.assert_close(compiled, eager, atol=1e-6, rtol=1e-6)


@needs_compiled_paths_torch
@pytest.mark.parametrize(
    "pe",
    [
        *("t5", "shaw", "shaw+pe.value_term=true", "alibi", "kerple", "rnope_swa", "fox"),
        *("fire", "fire+pe.init_threshold=1000"),
    ],
)
def test_a_block_on_the_gpus_flexattention_path_traces_as_one_graph(pe, compose_train, monkeypatch):
    """On CUDA T5's and Shaw's band bias (with a^V: flex's log-sum-exp and the band's weights), ALiBi's and KERPLE's,
    FIRE's (past its threshold, its MLP per score; within it, a table by distance), sliding windows (RNoPE-SWA's, at
    300 tokens past its window) and FoX's key bias in evaluation go to FlexAttention: that path, chosen here on the
    CPU, traces as one graph too (without a gradient: flex has no backward on a CPU), flex_attention compiled with
    the block (calling torch.compile in it, as Lightning wraps it, broke the graph 5 times). FIRE's learned thresholds,
    which decide its form, are read before the blocks, as the decoder does for compiled ones (they broke the graph)."""
    import torch._dynamo

    import lenext.attention as attention_module
    from lenext.pe.base import SPAN, forward_reads

    monkeypatch.setattr(attention_module, "flex_available", lambda q: True)
    pe, _, setting = pe.partition("+")
    net = tiny_module(compose_train, pe, *filter(None, [setting])).net
    x, positions = torch.randn(2, 300, net.d_model), torch.arange(300)[None]
    assert net.blocks[0].attn.window is None or net.blocks[0].attn.window < 300
    torch._dynamo.reset()
    with forward_reads(positions, {SPAN: 300}), torch.no_grad():
        net.pe.read_before_blocks(positions)  # as the decoder does before compiled blocks (FIRE's thresholds)
        explained = torch._dynamo.explain(net.blocks[0])(x, positions)
    assert explained.graph_break_count == 0, [str(b.reason).splitlines()[0] for b in explained.break_reasons]


def test_a_pes_span_is_the_forwards_for_its_positions_and_read_from_any_other():
    """Inside a forward, position_span of the forward's own positions is the span the decoder read (taken as given);
    of other positions (Self-Extend's grouped ones, say), read from them; outside a forward, read."""
    from lenext.pe.base import SPAN, forward_reads, position_span

    positions = torch.arange(64)[None]
    with forward_reads(positions, {SPAN: 99}):
        assert position_span(positions) == 99 and position_span(torch.arange(10)[None]) == 10
    with forward_reads(positions, {}):  # read by the first that needs it, then kept
        assert position_span(positions) == 64
        positions[0, -1] = 500
        assert position_span(positions) == 64
    assert position_span(positions) == 501 and position_span(torch.tensor([[0, 5, 900]])) == 901


@pytest.mark.parametrize(
    "pe, reads",
    [
        *((pe, 0) for pe in ("nope", "alibi", "kerple")),
        *((pe, 1) for pe in ("sinusoidal", "learned", "rope", "p_rope", "xpos")),
    ],
)
def test_a_training_step_reads_the_positions_span_once_or_not_at_all(pe, reads, compose_train):
    """A PE's tables need the positions' span; each layer read it from the device (.item()), and on a GPU each read
    waits for every kernel queued before it. It is read once a forward, by the first PE that needs it, and not at all
    at 0..L-1: a training step (forward and backward) reads no device value at sequential positions, and at drawn
    ones one where a PE needs the span (KERPLE's table on a CPU spans its band, not the positions); with activation
    checkpointing one (the decoder's, which the recomputed blocks reuse) for any PE."""
    from torch.profiler import ProfilerActivity, profile

    tokens = torch.randint(64, (2, 9), generator=torch.Generator().manual_seed(0))
    drawn = torch.tensor([[0, 2, 3, 5, 8, 9, 12, 15]])
    for checkpointed, positions, expected in ((False, None, 0), (False, drawn, reads), (True, drawn, 1)):
        net = tiny_module(compose_train, pe, activation_checkpointing=checkpointed).net
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            net.token_nll(tokens[:, :-1], tokens[:, 1:], positions).mean().backward()
        assert sum(e.name == "aten::_local_scalar_dense" for e in prof.events()) == expected


@needs_compiled_paths_torch
@pytest.mark.parametrize("threshold", [1000.0, 4.0])  # every query within L_thr (a table), past it (the MLP per score)
def test_fire_on_the_gpus_flexattention_path_reads_its_thresholds_once_a_forward(threshold, compose_train, monkeypatch):
    """Whether FIRE's bias is a table by distance depends on its learned thresholds: every layer read its own (a wait
    for the GPU each); now every layer's is read at once, once a forward: one read at 0..L-1 (the span is known), two
    at drawn positions (the span too), whatever the depth. Flex runs eager on the CPU, forward only."""
    from torch.profiler import ProfilerActivity, profile

    import lenext.attention as attention_module

    monkeypatch.setattr(attention_module, "flex_available", lambda q: True)
    monkeypatch.setattr(attention_module, "compiled_flex_attention", lambda: attention_module.flex_attention)
    lists = []  # a tensor's values as a list: a read the profiler does not show on a CPU
    monkeypatch.setattr(
        torch.Tensor, "tolist", lambda self, tolist=torch.Tensor.tolist: lists.append(1) or tolist(self)
    )
    tokens = torch.randint(64, (2, 9), generator=torch.Generator().manual_seed(0))
    drawn = torch.tensor([[0, 2, 3, 5, 8, 9, 12, 15]])
    for layers in (2, 4):
        overrides = f"model.n_layers={layers}", f"pe.init_threshold={threshold}", "pe.hidden=4"  # per score: 4 units
        net = tiny_module(compose_train, "fire", *overrides).net
        for positions, expected in ((None, 1), (drawn, 2)):
            lists.clear()
            with profile(activities=[ProfilerActivity.CPU]) as prof, torch.no_grad():
                net.token_nll(tokens[:, :-1], tokens[:, 1:], positions)
            assert sum(e.name == "aten::_local_scalar_dense" for e in prof.events()) + len(lists) == expected


@needs_compiled_paths_torch
def test_compiled_fire_blocks_on_the_gpus_flexattention_path_take_the_thresholds_the_decoder_read(monkeypatch):
    """The decoder reads FIRE's thresholds before compiled blocks (a PE made of PEs, here KERPLE's layer and FIRE's,
    passes the call on to FIRE): the blocks break no graph, and a forward reads one value at 0..L-1 and two at drawn
    positions, the eager output. A gradient is on (the compiled blocks run) with the parameters frozen: flex has no
    backward on a CPU."""
    import functools

    import torch._dynamo
    from torch._dynamo.utils import counters
    from torch.profiler import ProfilerActivity, profile

    import lenext.attention as attention_module
    from lenext.pe.mix import PerLayer

    monkeypatch.setattr(attention_module, "flex_available", lambda q: True)
    monkeypatch.setattr(attention_module, "compiled_flex_attention", lambda: attention_module.flex_attention)
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    lists = []  # a tensor's values as a list: a read the profiler does not show on a CPU
    counted = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: lists.append(1) or counted(self))
    fire = functools.partial(FIRE, hidden=4, init_threshold=64.0)  # past it, training leaves flex (said once)
    torch.manual_seed(0)
    pe = functools.partial(PerLayer, pes={"kerple": KERPLE, "fire": fire}, pattern=["kerple", "fire"])
    net = Decoder(64, 16, pe, d_model=32, n_layers=2, n_heads=2).requires_grad_(False)
    tokens = torch.randint(64, (2, 16))
    drawn = torch.tensor([[0, 2, 3, 5, 8, 9, 12, 15, 16, 17, 19, 20, 22, 23, 25, 30]])
    with torch.no_grad():
        eager = [net(tokens, positions) for positions in (None, drawn)]
    net.compile_blocks()
    torch._dynamo.reset()
    counters.clear()
    for positions, expected, reference in ((None, 1, eager[0]), (drawn, 2, eager[1])):
        net(tokens, positions)  # compiles the blocks for these positions (tracing reads what it traces)
        lists.clear()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            compiled = net(tokens, positions)
        assert sum(e.name == "aten::_local_scalar_dense" for e in prof.events()) + len(lists) == expected
        torch.testing.assert_close(compiled, reference)
    assert counters["stats"]["unique_graphs"] > 0 and not counters["graph_break"]
