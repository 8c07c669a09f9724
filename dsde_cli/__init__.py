"""The `dsde` command. It sits above the packages: `generate` and `prepare` need only dsde_core; `serve` and
`check-config` import services/ (and Ray) only when they run; `bench` is dsde_bench's."""
