"""Controller domain logic: plain Python, no grpc or protobuf, unit-tested directly."""
