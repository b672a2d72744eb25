"""Helpers the services and the tools share (flags, logs, tables): the lowest layer, no torch or grpc."""
