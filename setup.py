"""pyepl: Easy Parallel Library for TensorFlow 1.15 (import name ``epl``)."""
from setuptools import find_packages, setup

setup(
    name="pyepl",
    version="0.1.0",
    description="Easy Parallel Library: distributed training for TensorFlow 1.x graphs",
    license="Apache-2.0",
    packages=find_packages(include=["epl", "epl.*"]),
    package_data={"epl": ["lib/*.so"]},
    python_requires=">=3.7,<3.8",
    install_requires=["numpy<1.19", "protobuf<3.21"],
    extras_require={"cpu": ["tensorflow==1.15.5"], "gpu": ["tensorflow-gpu==1.15.5"]},
    entry_points={"console_scripts": ["epl-launch=epl.launcher:main"]},
)
