"""load/bench/wave_timeline.py: the phases of a wave read from ``perf script``'s text."""
from __future__ import annotations

from load.bench.wave_timeline import waves

GW, SVC, PA = 100, 200, 300
GW_HOP, SVC_HOP = 0x18, 0x13


def _line(tid: int, us: int, event: str, args: str) -> str:
    comm = "perf_analyzer" if tid == PA else "python"
    return f"          {comm}  {tid} [000] 1000.{us:06d}:  syscalls:{event}: {args}"


def _read(tid: int, us: int, fd: int, n: int) -> list[str]:
    return [_line(tid, us, "sys_enter_read", f"fd: 0x{fd:08x}, buf: 0x1, count: 0x3e800"),
            _line(tid, us + 1, "sys_exit_read", f"0x{n:x}")]


def _write(tid: int, us: int, fd: int) -> str:
    return _line(tid, us, "sys_enter_write", f"fd: 0x{fd:08x}, buf: 0x1, count: 0x10")


def _wave(t: int, hops: int) -> list[str]:
    """The service answers at t; the gateway reads it, answers two clients, perf_analyzer sends,
    the gateway reads the requests and sends ``hops`` hop messages; the next answer at t + 1000."""
    lines = [_write(SVC, t, SVC_HOP), *_read(GW, t + 40, GW_HOP, 600), _write(GW, t + 100, 0x16),
             _write(GW, t + 200, 0x17), _line(PA, t + 300, "sys_enter_sendmsg", "fd: 0x00000005, msg: 0x1"),
             *_read(GW, t + 350, 0x16, 1200), *_read(GW, t + 360, 0x17, 1200)]
    lines += [_write(GW, t + 500 + 100 * i, GW_HOP) for i in range(hops)]
    return lines


def test_the_phases_of_each_wave_and_the_hop_sends() -> None:
    text = "\n".join([*_wave(0, 2), *_wave(1000, 2), *_write(SVC, 2000, SVC_HOP).splitlines(),
                      *_read(SVC, 2500, 0x14, 8)])  # (a timer's read: not a hop read)
    found = waves(text, GW, SVC, GW_HOP, SVC_HOP)
    assert found["waves"] == 2 and found["hop_sends_per_wave"] == 2
    m = found["median_us"]
    assert m["A service answer -> gateway reads it"] == 41  # (the read's exit)
    assert m["B gateway read -> 1st client answer written"] == 59
    assert m["B' gateway read -> last client answer written"] == 159
    assert m["C 1st answer written -> client's 1st send"] == 200
    assert m["D client's send -> gateway reads it"] == 51
    assert m["E gateway's 1st request read -> 1st hop send"] == 149
    assert m["E' gateway's 1st request read -> last hop send"] == 249
    assert m["F last hop send -> service answer"] == 400
    assert m["wave"] == 1000


def test_one_hop_send_per_wave_is_counted_as_one() -> None:
    text = "\n".join([*_wave(0, 1), *_wave(1000, 1), _write(SVC, 2000, SVC_HOP)])
    assert waves(text, GW, SVC, GW_HOP, SVC_HOP)["hop_sends_per_wave"] == 1
