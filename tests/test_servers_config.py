"""Several generation servers, fast checks: rollout.num_servers / devices groups / urls at config load (each
error names its key), the eval CLI's --server (repeated) and --num-servers, and the launcher's device groups."""
import pytest

from apmpo import preflight
from apmpo.config import ConfigError, load_config
from apmpo.eval.__main__ import parse_args
from apmpo.rollout.launcher import device_groups


def rollout(*sets):
    return preflight.check(load_config(None, [f"rollout.{s}" for s in sets])).rollout


def test_one_server_is_the_default():
    r = load_config(None).rollout
    assert (r.num_servers, r.devices, r.url, r.urls, r.tensor_parallel_size) == (1, None, None, None, None)


@pytest.mark.parametrize("devices, groups", [
    ("3", ["3"]), ("4;5;6;7", ["4", "5", "6", "7"]), ("4,5;6,7", ["4,5", "6,7"]), (" 4 , 5 ; 6,7 ", ["4,5", "6,7"]),
])
def test_device_groups(devices, groups):
    assert device_groups(devices) == groups


@pytest.mark.parametrize("devices, message", [("4;;5", "empty device group"), ("4,;5", "empty device group"),
                                              ("4;4", "names GPU 4 twice"), ("4,5;5,6", "names GPU 5 twice")])
def test_bad_device_groups_fail_at_load_naming_the_key(devices, message):
    with pytest.raises(ValueError, match=message):
        device_groups(devices)
    with pytest.raises(ConfigError, match=f"rollout.devices: .*{message}"):
        rollout(f"devices={devices!r}", "num_servers=2")


def test_devices_groups_and_num_servers_must_agree():
    assert rollout("devices='4;5;6;7'", "num_servers=4").num_servers == 4
    r = rollout("devices='4,5;6,7'", "num_servers=2", "tensor_parallel_size=2")
    assert (r.devices, r.tensor_parallel_size) == ("4,5;6,7", 2)
    assert rollout("devices='4;5;6;7'").devices == "4;5;6;7"  # num_servers left at 1: one per group, as in eval
    with pytest.raises(ConfigError, match=r"rollout.devices: '4;5;6;7' names 4 server\(s\).*but 3 servers were"):
        rollout("devices='4;5;6;7'", "num_servers=3")
    with pytest.raises(ConfigError, match=r"rollout.tensor_parallel_size \(1\) must equal the GPUs of each server"):
        rollout("devices='4,5;6,7'", "num_servers=2", "tensor_parallel_size=1")
    with pytest.raises(ConfigError, match=r"rollout.num_servers must lie in \[1, 1024\], got 0"):
        rollout("num_servers=0")


def test_urls_of_running_servers():
    r = rollout('urls=["http://node2:8000", "http://node3:8000"]')
    assert r.urls == ["http://node2:8000", "http://node3:8000"] and r.url is None
    assert rollout("url=http://node2:8000").url == "http://node2:8000"  # one server, as before
    for sets, message in [
        (['urls=["http://a:1"]', "url=http://b:2"], "rollout.url and rollout.urls are both set"),
        (['urls=["http://a:1", "http://a:1"]'], "rollout.urls must list distinct"),
        (['urls=["node2:8000"]'], "rollout.urls must list distinct http"),
        (["urls=[]"], "rollout.urls must list"),
        (['urls=["http://a:1", "http://b:2"]', "num_servers=3"], r"rollout.num_servers \(3\) is for servers the run"),
        (["urls=http://a:1"], "rollout.urls expects a list, got str"),
        (["urls=[1]"], "rollout.urls must list distinct http"),
    ]:
        with pytest.raises(ConfigError, match=message):
            rollout(*sets)


def test_eval_cli_takes_several_servers_or_num_servers(tmp_path, capsys):
    args = parse_args(["--model", "m", "--out", str(tmp_path), "--server", "http://a:1", "--server", "http://b:2"])
    assert args.server == ["http://a:1", "http://b:2"] and args.num_servers == 1
    args = parse_args(["--model", "m", "--out", str(tmp_path), "--num-servers", "2"])
    assert args.server is None and args.num_servers == 2
    assert parse_args(["--model", "m", "--out", str(tmp_path), "--devices", "0,1;2,3"]).devices == "0,1;2,3"
    for argv, message in [(["--num-servers", "2", "--server", "http://a:1"], "--num-servers starts servers"),
                          (["--num-servers", "0"], "--num-servers must be >= 1"),
                          (["--devices", "0;;1"], "--devices: '0;;1' has an empty device group"),
                          (["--devices", "0;1", "--num-servers", "3"], "--devices: '0;1' names 2 server(s)"),]:
        with pytest.raises(SystemExit) as exit_:
            parse_args(["--model", "m", "--out", str(tmp_path), *argv])
        assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_greedy_with_several_samples_is_a_422_not_a_500():
    # vLLM raised "n must be 1 when using greedy sampling" while /generate built the request: a bare 500.
    from pydantic import ValidationError

    from apmpo.rollout.protocol import GenerateRequest

    good = dict(prompts=[[1, 2]], temperature=0.0, top_p=1.0, top_k=-1, max_tokens=4)
    assert GenerateRequest(**good, n=1).n == 1
    with pytest.raises(ValidationError, match="n must be 1 with temperature 0"):
        GenerateRequest(**good, n=3)
