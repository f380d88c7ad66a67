"""`torchrun ... -m zeroshard.toolkit reshard|consolidate ...`: the `zeroshard` command, which shares
the work among torchrun's processes by itself (zeroshard.toolkit.distributed)."""

from zeroshard.cli import main

main(prog_name="zeroshard")
