"""The plugin's terminal sections: one row per engine cycle with its verdict, and the sanitizer's findings."""

from __future__ import annotations

import os
import sys
from typing import Any

from cudagraph_lifecycle.errors import (
    FRESH_POOL_FIX,
    TORCH_DEFAULT_STREAM_REFUSAL,
    TORCH_POOL_ASSERT,
    TORCH_RANDOM_POISONED,
    exception_chain,
)
from cudagraph_lifecycle.ledger import innermost_user_frames, ledger  # plain Python: no torch

from .report import VERDICTS, findings, lifecycle_line, rows, shown_key, totals


def _who(c: dict) -> str:
    pid = str(c.get("pid") or "-")
    return pid if c.get("rank") is None else f"{pid}/r{c['rank']}"


def _mib(n: int) -> str:
    """Bytes as the table shows them: 0, 512B, 34.0M (MiB), with the sign of a negative figure."""
    if n < 0:
        return "-" + _mib(-n)
    return "0" if not n else f"{n / 2**20:.1f}M" if n >= 2**20 else f"{n}B"


def short_id(nodeid: str, width: int) -> str:
    """A test id cut to ``width``, keeping its file's name and the end of the test's name (where parameters
    and the words that tell tests apart are): ``test_lifecycle.py::…on_its_second_instance``. An ellipsis
    marks only what was cut."""
    if len(nodeid) <= width:
        return nodeid
    if width < 8:
        return nodeid[len(nodeid) - max(width, 0):]
    path, sep, test = nodeid.partition("::")
    if not sep:  # no test part: the end of the path
        return "…" + nodeid[-(width - 1):]
    head = path.rsplit("/", 1)[-1] + sep
    room = width - len(head)
    if room >= min(len(test), 16):  # the file's name whole, and as much of the test's as fits
        return head + (test if len(test) <= room else "…" + test[-(room - 1):])
    tail = test if len(test) <= 16 else "…" + test[-15:]
    return path.rsplit("/", 1)[-1][:width - len(tail) - len(sep) - 1] + "…" + sep + tail


def table_names(nodeids: list[str], width: int) -> tuple[dict[str, str], list[str]]:
    """Each test's name in a table column of ``width``, and a legend: tests whose cut names would read alike
    get a number (``[1]``), and the legend gives their whole ids."""
    names = {n: short_id(n, width) for n in dict.fromkeys(nodeids)}
    seen: dict[str, list[str]] = {}
    for n, cut in names.items():
        seen.setdefault(cut, []).append(n)
    legend = []
    for same in seen.values():
        if len(same) < 2:
            continue
        for n in same:
            tag = f" [{len(legend) + 1}]"
            names[n] = short_id(n, width - len(tag)) + tag
            legend.append(f"{tag.strip()} {n}")
    return names, legend


def lifecycle_section(tr: Any, state: dict, backend: str | None) -> None:
    cycles = rows(state)
    if not cycles:
        return
    tr.section("cudagraph lifecycle")
    tr.write_line(f"{'test':<44} {'#':>2} {'pid/rank':>9} {'pools':>9} {'graphs':>6} {'capture ms':>10} "
                  f"{'pool':>7} {'held':>7} {'leaked':>7} {'growth':>7} verdict")
    cold = False
    names, legend = table_names([nodeid for nodeid, _ in cycles], 44)
    # pool ids repeat across devices: where a table's pools sit on more than one, each id names its device
    devices = {p[0] for _, c in cycles for p in c.get("pool_ids") or []}
    on = (lambda d: f"@{d}") if len(devices) > 1 else (lambda d: "")
    for nodeid, c in cycles:
        pools = ",".join(f"{p[1][0]}:{p[1][1]}{on(p[0])}" for p in c.get("pool_ids") or []) or "-"
        name = names[nodeid]
        verdict = c.get("verdict", "?") + (" FAILED" if c.get("failed") else "")
        ms = f"{c.get('capture_ms', 0.0):.1f}" + ("*" if c.get("cold") else " ")  # the digits stay aligned
        cold = cold or bool(c.get("cold"))
        tr.write_line(
            f"{name:<44} {c['index']:>2} {_who(c):>9} {pools:>9} {c.get('graphs', 0):>6} "
            f"{ms:>10} {_mib(c.get('pool_bytes', 0)):>7} {_mib(c.get('held_bytes', 0)):>7} "
            f"{_mib(c.get('leaked_bytes', 0)):>7} {_mib(max(c.get('growth_bytes', 0), c.get('kept_bytes', 0))):>7} "
            f"{verdict}"
        )
        if c.get("freed_earlier_bytes"):
            tr.write_line(f"{'':<48}  default pool: {_mib(c['freed_earlier_bytes'])} held from before this engine went "
                          "during it (library workspaces torch._dynamo.reset() drops, an earlier engine's caches); "
                          "growth counts what an engine leaves")
        if c.get("graph_bytes"):
            per = ", ".join(f"{k}: {_mib(v)}" for k, v in c["graph_bytes"].items())
            tr.write_line(f"{'':<48}  pool bytes per graph (batch: bytes its capture added): {per}")
        for p in c.get("problems") or []:
            first = p["message"].strip().splitlines()[0] if p["message"].strip() else p["kind"]
            tr.write_line(f"{'':<48}! {p['kind']}: {first}")
    if legend:  # tests whose cut names read alike
        tr.write_line("tests whose cut ids read alike: " + legend[0])
        for line in legend[1:]:
            tr.write_line(f"{'':<32}{line}")
    if len(devices) > 1:
        tr.write_line("pools: a pool id and, after @, the device it is on")
    if cold:
        tr.write_line("* the first capture in its worker process: it includes that process's first use of torch "
                      "(kernels, allocator segments, lazy imports); compare the engines after it")
    t = totals(state)
    counts = ", ".join(f"{t[v]} {v}" for v in VERDICTS if t[v] or v in ("fresh", "held"))
    tr.write_line(f"{t['cycles']} engine cycle{'' if t['cycles'] == 1 else 's'}: {counts}; {t['failed_cycles']} failed; "
                  f"{lifecycle_line(t)}; backend {backend}")


def finding_lines(f: dict, nodeid: str, named: bool = True) -> list[str]:
    """One finding of test ``nodeid`` as the user reads it: what and where (the pool, its device, its bytes;
    after the test's id where ``named``), the message, the sites it does not name already, the other tests
    that captured into the pool, and the innermost frames of the user's code of each stack (the JSON keeps
    the whole stacks)."""
    made = f" (made by {f['engine']})" if f.get("engine") and not f["engine"].startswith(nodeid) else ""
    rank = f" of rank {f['rank']}" if f.get("rank") is not None else ""
    began = f["kind"] == "default_stream_capture"  # a capture that never happened: no pool, no bytes
    what = f"device {f['device']}{rank}" if began else \
        f"pool {tuple(f['pool_id'])} on device {f['device']}{rank}" + (f", {_mib(f['bytes'])}" if f["bytes"] else "")
    out = [f"{f'{nodeid}: ' if named else ''}{f['kind']}: {what}{made}", f"    {f['message']}"]
    tried = {"default_stream_capture": "began", "stale_capture": "tried"}.get(f["kind"], "captured")
    out += [f"    {tried} at {site}" for site in f.get("sites") or [] if site not in f["message"]]
    out += [f"    also captured into by {other}" for other in (f.get("tests") or [])[1:]]
    for stack in f.get("stacks") or []:
        lines = stack.rstrip().splitlines()
        if lines and lines[0].startswith("--- "):  # a labelled stack (which of a finding's several it is)
            out.append(f"    {lines.pop(0)}")
        out += [f"      {line}" for line in innermost_user_frames("\n".join(lines), 3)]
    return out


def findings_section(tr: Any, state: dict) -> None:
    """The sanitizer's findings: a cudagraph-marked test's own, the workers' engine cycles', and a
    program-wide sanitizer's (``CUDAGRAPH_SANITIZE=1``) at the session's end, each under its test, with
    where its pool was captured and what pins it (``on`` reports them here and in the JSON; ``strict`` also
    fails the test, whose error shows them whole: here they are one line each)."""
    found = findings(state)
    if not found:
        return
    tr.section("cudagraph sanitizer")
    tests = state["tests"]
    for nodeid, f in found:
        lines = finding_lines(f, nodeid)
        entry = tests.get(nodeid, {})
        if shown_key(f) in (entry.get("findings_in_error") or ()):
            lines = [lines[0], "    failed the test: its error above shows the whole finding"]
        for line in lines:
            tr.write_line(line)
    strict, by = state.get("strict_findings", 0), state.get("strict_by")
    if by == "--cudagraph-sanitize=strict":  # the tests' own failed their tests already
        tail = "" if not strict else f"; {by}: {strict} of them, found in shared workers when they closed, " + \
            ("fails" if strict == 1 else "fail") + " the session"
    else:
        tail = "" if not strict else f"; {by}: they fail the session" if strict == len(found) \
            else f"; {by}: {strict} of them fail the session (the rest are xfailed or skipped tests')"
    tr.write_line(f"{len(found)} sanitizer finding(s)" + tail)


REFUSAL_NOTE = "torch refused a capture on the default stream"
_PREVENTED = ("DefaultStreamCaptureError", "StalePoolError")  # the sanitizer stopped it: the process is fine


def _process_worlds() -> set:
    """The allocator worlds of this process (an isolated ``SimBackend()`` of a test poisons only itself)."""
    worlds = {"cuda"}
    sim = sys.modules.get("cudagraph_lifecycle.backends.sim")
    process = getattr(getattr(sim, "SimBackend", None), "_process", None)
    if process is not None:
        worlds.add(process.world)
    return worlds


def refusal_site(excinfo: Any) -> str:
    """``file:line in function`` of the innermost frame of a failure's traceback outside torch, this library
    and pytest: where the test began the capture torch refused."""
    skip = (f"{os.sep}torch{os.sep}", "cudagraph_lifecycle", f"{os.sep}_pytest{os.sep}", f"{os.sep}pluggy{os.sep}")
    for entry in reversed(list(excinfo.traceback)):
        path = str(entry.path)
        if not any(s in path for s in skip):
            return f"{path}:{entry.lineno + 1} in {entry.name}"
    return "(unknown)"


def poison_note(exc: BaseException | None, earlier: list[str] | tuple = ()) -> str | None:
    """A failed test's note where what failed it in this process is torch's refusal of a capture on the default
    stream, or a random op of a process that refusal (or the allocator's assert) poisoned: what did it, where
    the ledger saw it (else ``earlier``: the refusals that failed earlier tests of this process, as
    ``nodeid at file:line``), how to have it refused first. None for anything else, for what the sanitizer
    stopped, and for a worker's errors (that process is replaced)."""
    chain = exception_chain(exc)
    names = {type(e).__name__ for e in chain}
    if not chain or names & set(_PREVENTED) or type(exc).__module__.startswith("pytest_cudagraph"):
        return None
    # what torch raises is a RuntimeError (an assert that merely compares these words is not it)
    text = "\n".join(str(e) for e in chain if isinstance(e, RuntimeError))
    if not any(m in text for m in (TORCH_DEFAULT_STREAM_REFUSAL, TORCH_RANDOM_POISONED, TORCH_POOL_ASSERT)):
        return None
    worlds = _process_worlds()
    seen = ledger.torch_refusals(worlds=worlds)[::-1]
    where = "; ".join([f"{d.test or '(outside a test)'} at {d.site or '(unknown)'}" for d in seen[:3]]
                      or list(reversed(earlier))[:3])  # else the refusals that failed earlier tests here
    asserted = "; ".join(f"{a.test or '(outside a test)'} at {a.site or '(unknown)'}"
                         for a in ledger.allocator_asserts(worlds=worlds)[::-1][:3])
    fix = ("With the sanitizer on (cudagraph-marked tests and workers under --cudagraph-sanitize=on, or "
           "CUDAGRAPH_SANITIZE=1 for the whole session) such a capture is refused before torch begins it, "
           "and named with its test and line.")
    if TORCH_DEFAULT_STREAM_REFUSAL in text:
        return (f"{REFUSAL_NOTE} after opening the CUDA RNG's capture: from now on "
                "every eager random op of this process fails, in later tests too. Capture on a side stream "
                f"(`with torch.cuda.stream(s):`). {fix}")
    if TORCH_POOL_ASSERT in text and TORCH_RANDOM_POISONED not in text:
        return ("the caching allocator asserted on a capture into a released pool (a pool id kept after all its "
                "graphs were reset, while a tensor of it lived or before a cache flush): this process's allocator "
                f"and random ops stay poisoned, in later tests too. {FRESH_POOL_FIX}. {fix}")
    causes = ([f"by a capture on the default stream (newest first): {where}"] if where else []) + (
        [f"by the allocator's `use_count > 0` assert on a capture into a released pool (newest first): {asserted}"]
        if asserted else [])
    cause = " and ".join(causes) or (
        "by a capture on the default stream, or by the allocator's `use_count > 0` assert (a capture into a "
        "released pool), in this test or an earlier one; nothing watching saw which")
    return (f"this process's eager CUDA random ops were poisoned {cause}. A new process is the sure way back (after "
            f"torch's default-stream refusal a later capture that ends also clears it, measured on the H200). {fix}")
