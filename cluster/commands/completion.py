"""`cluster completion bash|zsh`: print the shell code that completes `cluster` commands and flags.

The completions come from the CLI's own parser through argcomplete (cluster.cli.main hands the
parser to argcomplete when the shell asks). Activate once per shell, or put it in the rc file:
`eval "$(cluster completion bash)"` (~/.bashrc) or `eval "$(cluster completion zsh)"` (~/.zshrc).
"""

from __future__ import annotations

import argparse
import sys

SHELLS = ("bash", "zsh")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "completion", help="print shell completion code for bash or zsh",
        description="Print the code that makes bash or zsh complete cluster's commands and "
                    "flags (through argcomplete).",
        epilog='Activate: eval "$(cluster completion bash)" in ~/.bashrc, or '
               'eval "$(cluster completion zsh)" in ~/.zshrc.')
    p.add_argument("shell", choices=SHELLS, help="the shell to complete in")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import argcomplete

    sys.stdout.write(argcomplete.shellcode(["cluster"], shell=args.shell))
    return 0
