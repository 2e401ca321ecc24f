"""A sandbox for model-written Python: hostile code ends in a defined result, never harm.

`run_python(code, stdin)` runs one program in a separate process tree and returns a
`SandboxResult(status, stdout, stderr, duration_s)`, status one of STATUSES ("ok", "error",
"timeout", "memory", "killed"); `run_many` runs several at once. The run is contained at the
strongest isolation level this machine gives (`isolation_level()`: "namespaces", "userns",
"landlock" or "rlimits"); a weak level is refused unless the policy allows it
(`set_isolation_policy("allow_weak")`, `sandbox.isolation: allow_weak` in the config, or
JMARL_SANDBOX_ISOLATION=allow_weak). docs/sandbox.md has what each level guarantees.

At every level: a minimal environment (nothing inherited from the parent), `python -I -S -B`
reading the source from an inherited file descriptor (no path to the private job directory),
resource limits (CPU time, address space, file size, open files, processes, no core dumps),
the launcher as child subreaper with parent-death signals, and an audit hook in the program's
interpreter that refuses network calls, writes outside the working directory and reading other
processes' /proc entries (and, at "landlock" and "rlimits", reading or listing outside the working
directory and the interpreter's and system's directories, process creation, signals and ctypes).
The audit hook is defense in depth only: ctypes can bypass it, the kernel mechanisms cannot be.
The parent reads output incrementally and stops at `max_output_bytes`; on timeout, on output
flood, or when the program ends, every remaining process of the run is killed (the PID
namespace's init dying kills the rest) and reaped, and the temporary directory is removed.

Modules, from the caller down:
  runner.py      run_python, run_many: check the limits, apply the policy, run.
  policy.py      the isolation policy (strict / allow_weak), require_isolation, run_summary.
  levels.py      the isolation levels and detecting this machine's (isolation_level).
  spawn.py       one run at a given level, from the parent's side (run_at_level).
  filesystem.py  the host paths a program may see (the private root's layout).
  result.py      SandboxResult, STATUSES, a run's status from its wait status.
  launcher.py    runs inside the sandbox: isolates the run, starts the program's interpreter.
  audit_hook.py  runs inside the sandbox: the program's interpreter with its audit hook.
The two last ones import only the standard library: their source is shipped to `python -c`.
"""

from jmarl.sandbox.levels import ISOLATION_LEVELS, WEAK_LEVELS, isolation_level
from jmarl.sandbox.policy import (
    ISOLATION_POLICIES,
    isolation_policy,
    require_isolation,
    run_summary,
    set_isolation_policy,
)
from jmarl.sandbox.result import STATUSES, SandboxResult
from jmarl.sandbox.runner import run_many, run_python

__all__ = [
    "ISOLATION_LEVELS",
    "ISOLATION_POLICIES",
    "STATUSES",
    "WEAK_LEVELS",
    "SandboxResult",
    "isolation_level",
    "isolation_policy",
    "require_isolation",
    "run_many",
    "run_python",
    "run_summary",
    "set_isolation_policy",
]
