"""Helpers the services and the tools share: flags, logs and tables (no torch or grpc imports, so
the CLI stays light), and the internal token (auth) and TLS credentials (tls), which use grpc."""
