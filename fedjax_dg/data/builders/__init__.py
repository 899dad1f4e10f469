"""The project's own TFDS builders (prepared as array_record, readable without TF).

Importing this package imports `tensorflow_datasets`; `fedjax_dg.data.sources`
imports it lazily, only when a dataset has to be prepared or read.
"""

from fedjax_dg.data.builders.domainbed_folder import DomainBedFolder
from fedjax_dg.data.builders.domainbed_folder import OfficeHome
from fedjax_dg.data.builders.domainbed_folder import Pacs
from fedjax_dg.data.builders.domainbed_folder import Vlcs
from fedjax_dg.data.builders.fashion_mnist import FashionMnistSplits
from fedjax_dg.data.builders.mini_domainnet import MiniDomainnet
from fedjax_dg.data.builders.rotated_fashion_mnist import RotatedFashionMnist
from fedjax_dg.data.builders.styled_fashion_mnist import StyledFashionMnist
from fedjax_dg.data.builders.tiny_imagenet import TinyImagenet

__all__ = [
    "DomainBedFolder",
    "FashionMnistSplits",
    "MiniDomainnet",
    "OfficeHome",
    "Pacs",
    "RotatedFashionMnist",
    "StyledFashionMnist",
    "TinyImagenet",
    "Vlcs",
]
