"""CLI subcommands: one module per `nla <command>`, each with `register(subparsers)`."""
