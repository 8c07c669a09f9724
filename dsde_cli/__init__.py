"""The `dsde` command. It sits above both packages: `generate` and `prepare` need only dsde_core, `serve`
reaches services/ (and Ray), imported only when it runs."""
