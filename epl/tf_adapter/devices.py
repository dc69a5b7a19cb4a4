"""The devices of this process as TensorFlow sees them.

TensorFlow's public ``tf.config.list_physical_devices`` lists the hardware; the devices
a session would make (those of a GPU TensorFlow can use: visible, of a supported
compute capability) are only listed by the private ``device_lib``: kept here.
"""
from tensorflow.python.client import device_lib as _device_lib


def local_gpu_count():
    """How many GPU devices TensorFlow makes in this process."""
    return sum(1 for d in _device_lib.list_local_devices() if d.device_type == "GPU")
