"""Generated protobuf code; do not edit."""
