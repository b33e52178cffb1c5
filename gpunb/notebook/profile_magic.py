"""%gpuprofile: a thin front-end over gpunb.profiling.profile.

`register(ipython)` adds the magic; gpunb's load_ipython_extension calls it. The
statement or cell runs in the user namespace, once per profiled step.
"""

from __future__ import annotations

import re

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class, no_var_expand
from IPython.core.magic_arguments import argument, magic_arguments

from gpunb.notebook.options import make_strict, usage_errors

# A token of the magic line: runs of non-blanks, quoted parts kept whole ("my dir").
_TOKEN = re.compile(r"""(?:"[^"]*"|'[^']*'|\S)+""")
_TAKES_VALUE = ("--steps", "--warmup", "--save")
_STEPS = object()  # `--train` without N: as many steps as --steps says


@magics_class
class ProfileMagics(Magics):
    @magic_arguments()
    @argument("--steps", type=int, default=10, metavar="N", help="steps to record (default 10).")
    @argument("--warmup", type=int, default=2, metavar="N",
              help="steps to run first without recording: compilation, caches, allocator (default 2).")
    @argument("--save", metavar="DIR", default=None,
              help="write the chrome/Perfetto trace (.pt.trace.json) into DIR; the report prints its path.")
    @argument("--train", nargs="?", type=int, const=_STEPS, default=None, metavar="N",
              help="profile N optimizer steps (default: --steps) of the last %%%%gputrain cell's set-up.")
    @argument("statement", nargs="*", help="code to run once per step (or give a cell with %%%%gpuprofile).")
    @no_var_expand  # the line is Python code: `{}` and `$` are the user's, as in %timeit
    @line_cell_magic
    def gpuprofile(self, line: str, cell: str | None = None):
        """Profile a statement, a cell or training steps: where the time goes and what to change.

            %gpuprofile model(x).sum().backward()     # the statement, once per step
            %%gpuprofile --steps 20                   # the cell body, once per step
            loss = loss_fn(model(x), y); loss.backward(); opt.step(); opt.zero_grad()
            %gpuprofile --train 20                    # 20 steps of the last %%gputrain set-up

        `--warmup` steps run first unrecorded, then one step while the profiler starts (not
        counted), then `--steps` steps recorded by torch.profiler.
        The report shows, for training, each step split into data wait, host-to-device copy,
        forward, backward, optimizer and other (ms and %); on a GPU, how busy it was and
        whether it waited on the host or on data; the top ops and kernels; peak memory; and
        advice that fires on evidence, each with what it saw and an estimated gain. `--train`
        takes the variables the last %%gputrain trained with (`model`, `train_data`, ...) as
        they are now in the notebook, and puts the model's weights and optimizer state back
        afterwards.
        The result is returned: `r = _` keeps it (`r.advice`, `r.phases`, ...).
        Python API: `gpunb.profiling.profile(fn)` or `profile(train=dict(model=..., train_data=...))`.
        """
        options, statement = _split_line(line)
        args = self.gpuprofile.parser.parse_args(options)  # a MagicArgumentParser: errors are UsageErrors
        if cell is not None and statement:
            raise UsageError(f"%%gpuprofile takes only options on its line, got {statement!r}.\n"
                             "Put the code in the cell body.")
        code = cell if cell is not None else statement
        from gpunb.profiling import api

        steps = args.steps if args.train in (None, _STEPS) else args.train
        with usage_errors():
            api.check_options(steps, args.warmup, args.save)
            if args.train is not None:
                if code and code.strip():
                    raise UsageError("--train profiles the last %%gputrain set-up, so it takes no code.\n"
                                     "Drop the code, or drop --train to profile the code.")
                return api.profile(train=_last_train(self.shell.user_ns), steps=steps, warmup=args.warmup, save=args.save)
        if not code or not code.strip():
            raise UsageError("Nothing to profile.\n"
                             "Give a statement (`%gpuprofile model(x).sum().backward()`), a cell under "
                             "`%%gpuprofile`, or `%gpuprofile --train` after a %%gputrain cell.")
        compiled = compile(self.shell.transform_cell(code), "<gpuprofile>", "exec")
        namespace = self.shell.user_ns
        # Errors in the user's code propagate with their own traceback.
        return api.profile(lambda: exec(compiled, namespace), steps=steps, warmup=args.warmup, save=args.save)


make_strict(ProfileMagics.gpuprofile)


def register(ipython) -> None:
    """Add %gpuprofile / %%gpuprofile to `ipython` (gpunb's load_ipython_extension calls this)."""
    ipython.register_magics(ProfileMagics)


def _split_line(line: str) -> tuple[list[str], str]:
    """The leading options (quotes removed), and the statement after them exactly as typed."""
    tokens = list(_TOKEN.finditer(line))
    options, i = [], 0
    while i < len(tokens) and tokens[i].group().startswith("--"):
        option = tokens[i].group()
        options.append(option)
        i += 1
        if i < len(tokens) and "=" not in option:
            value = tokens[i].group()
            if option in _TAKES_VALUE or (option == "--train" and value.isdigit()):
                options.append(value)
                i += 1
    statement = line[tokens[i].start():].strip() if i < len(tokens) else ""
    return [_unquote(o) for o in options], statement


def _unquote(token: str) -> str:
    return token[1:-1] if len(token) > 1 and token[0] == token[-1] and token[0] in "\"'" else token


def _last_train(namespace: dict) -> dict:
    """The last %%gputrain set-up as profile(train=...) takes it, its variables looked up again now."""
    from gpunb.notebook import session

    last = session.LAST_TRAIN
    if last is None:
        raise UsageError("%gpuprofile --train profiles the last %%gputrain set-up, and there is none yet.\n"
                         "Run a %%gputrain cell first (or profile a statement: `%gpuprofile step()`).")
    missing = [name for name in last.names.values() if name not in namespace]
    if missing:
        listed = ", ".join(f"`{name}`" for name in missing)
        raise UsageError(f"%gpuprofile --train profiles the last %%gputrain set-up, but {listed} "
                         f"{'is' if len(missing) == 1 else 'are'} no longer defined in the notebook.\n"
                         "gpunb keeps the names of that set-up, not the objects, so deleted ones are freed.\n"
                         "HINT: run the %%gputrain cell again (it defines them), or define "
                         f"{listed} again before `%gpuprofile --train`.")
    return {"config": last.config, **{role: namespace[name] for role, name in last.names.items()}}
