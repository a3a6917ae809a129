"""One options type (#35): ``fsdp_ema.EMAConfig`` holds every EMA option, one documented field
each, checks them when made (naming the option and whom the user called) and prints them whole;
``ShardedEMA``, ``ShardedPowerEMA`` and both callbacks take it and still take the keywords; the
settings a resume compares are its fields marked *compared*; the host-memory test hook is out of
the public signature."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest
import torch
from torch import nn

import fsdp_ema
from fsdp_ema import EMAConfig, ShardedEMA, ShardedPowerEMA, Warmup
from fsdp_ema.config import RESUME_SETTINGS
from fsdp_ema.store import binding as _binding


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Linear(5, 2))


def test_every_field_has_a_docstring_and_repr_prints_them_all():
    tree = ast.parse(Path(inspect.getsourcefile(EMAConfig)).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EMAConfig")
    documented = [a.target.id for a, d in zip(cls.body, cls.body[1:])
                  if isinstance(a, ast.AnnAssign) and isinstance(d, ast.Expr)
                  and isinstance(d.value, ast.Constant) and isinstance(d.value.value, str)]
    names = [f.name for f in dataclasses.fields(EMAConfig)]
    assert documented == names
    text = repr(EMAConfig())
    assert all(f"{n}=" in text for n in names), text


def test_values_are_normalized_and_checked_naming_the_caller():
    c = EMAConfig(decay=1, warmup=True, update_every=2.0, start_step=3)
    assert c.warmup == Warmup() and type(c.decay) is float
    assert type(c.update_every) is int and c.update_every == 2 and c.start_step == 3
    with pytest.raises(ValueError, match=r"^EMAConfig: update_every must be an integer >= 1"):
        EMAConfig(update_every=0)
    with pytest.raises(ValueError, match=r"^ShardedEMA: decay must be in \[0, 1\], got 1.5"):
        ShardedEMA(net(), decay=1.5)
    with pytest.raises(ValueError, match=r"^ShardedEMA: dtype must be one of"):
        ShardedEMA(net(), EMAConfig(), dtype=torch.int32)
    with pytest.raises(TypeError, match=r"^ShardedEMA: unexpected option\(s\) 'warmupp'"):
        ShardedEMA(net(), warmupp=True)
    with pytest.raises(TypeError, match="the decay given twice"):
        ShardedEMA(net(), 0.9, decay=0.8)
    with pytest.raises(TypeError, match=r"^ShardedEMA: include_buffers must be True or False, "
                                        r"got 'no'"):
        ShardedEMA(net(), include_buffers="no")
    with pytest.raises(TypeError, match=r"^EMAConfig: process_group must be None \(the default "
                                        r"group\) or a torch.distributed.ProcessGroup, got 2"):
        EMAConfig(process_group=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.decay = 0.5


def test_a_config_a_positional_decay_and_keywords_make_the_same_ema():
    model = net()
    config = EMAConfig(decay=0.99, warmup=Warmup(power=0.75), update_every=2, buffers="copy")
    by_keywords = ShardedEMA(model, decay=0.99, warmup=Warmup(power=0.75), update_every=2,
                             buffers="copy")
    by_config = ShardedEMA(model, config)
    by_both = ShardedEMA(model, EMAConfig(decay=0.5, update_every=2), decay=0.99,
                         warmup=Warmup(power=0.75), buffers="copy")
    assert by_keywords.config == by_config.config == by_both.config == config
    assert ShardedEMA(model, 0.99).config == EMAConfig(decay=0.99)
    assert (by_config.decay, by_config.update_every, by_config.warmup) == (0.99, 2, config.warmup)
    assert _binding.settings(by_config) == _binding.settings(by_keywords)
    with pytest.raises(AttributeError):
        by_config.config = EMAConfig()


def test_the_settings_a_resume_compares_are_the_compared_fields():
    assert RESUME_SETTINGS == ("decay", "warmup", "schedule", "update_every", "start_step",
                               "dtype", "params", "buffers")
    assert _binding.SETTINGS is RESUME_SETTINGS
    ema = ShardedEMA(net(), EMAConfig(decay=0.9, dtype=None, params="trainable"))
    assert _binding.settings(ema) == {
        "decay": 0.9, "warmup": None, "schedule": None, "update_every": 1, "start_step": 0,
        "dtype": None, "params": "trainable", "buffers": "average"}
    plain = ShardedEMA(nn.Linear(3, 3), buffers="copy")  # no buffer: recorded as None
    assert _binding.settings(plain)["buffers"] is None


def test_power_ema_takes_the_fields_its_profiles_leave_open():
    model = net()
    ema = ShardedPowerEMA(model, (0.05, 0.10), config=EMAConfig(update_every=2), dtype=None)
    assert ema.config.update_every == 2 and ema.config.dtype is None
    assert isinstance(ema.config.schedule, fsdp_ema.PowerEMA)
    with pytest.raises(TypeError, match=r"unexpected option\(s\) 'decay'"):
        ShardedPowerEMA(model, decay=0.9)
    with pytest.raises(TypeError, match="takes no start_step"):
        ShardedPowerEMA(model, config=EMAConfig(start_step=3))


def test_the_host_memory_test_hook_is_out_of_the_public_signature():
    from fsdp_ema.ema.offload import forced_for_cpu_models

    assert "_offload" not in inspect.signature(ShardedEMA).parameters
    with pytest.raises(TypeError, match="'_offload'"):
        ShardedEMA(net(), device="cpu", _offload=True)
    assert ShardedEMA(net(), device="cpu").state.host is None  # a CPU model: the ordinary EMA
    with forced_for_cpu_models():
        assert ShardedEMA(net(), device="cpu").state.host is not None
    assert ShardedEMA(net(), device="cpu").state.host is None


def test_both_callbacks_take_a_config_and_check_it_when_made():
    pytest.importorskip("lightning")
    pytest.importorskip("transformers")
    from fsdp_ema.integrations.lightning import ShardedEMA as LightningEMA
    from fsdp_ema.integrations.transformers import ShardedEMACallback

    config = EMAConfig(decay=0.999, warmup=True, update_every=2)
    assert LightningEMA(config).config == config
    assert ShardedEMACallback(config, update_every=4).config.update_every == 4
    assert LightningEMA(decay=0.5).config == EMAConfig(decay=0.5)
    assert ShardedEMACallback(0.5).config == EMAConfig(decay=0.5)
    with pytest.raises(ValueError, match=r"^ShardedEMACallback: buffers must be"):
        ShardedEMACallback(buffers="sum")
    with pytest.raises(TypeError, match=r"^ShardedEMA: unexpected option\(s\) 'warmupp'"):
        LightningEMA(warmupp=True)
