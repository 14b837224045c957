"""The private descriptor pool every generated meshserve module registers in."""
from google.protobuf import descriptor_pool

POOL = descriptor_pool.DescriptorPool()
