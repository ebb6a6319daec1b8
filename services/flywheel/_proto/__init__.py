"""Generated from proto/flywheel/v1 by tools/gen_proto.py; do not edit."""
