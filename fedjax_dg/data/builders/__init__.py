"""The project's own TFDS builders (prepared as array_record, readable without TF).

Importing this package imports `tensorflow_datasets`; `fedjax_dg.data.sources`
imports it lazily, only when a dataset has to be prepared or read.
"""

from fedjax_dg.data.builders.domainbed_folder import DomainBedFolder
from fedjax_dg.data.builders.domainbed_folder import OfficeHome
from fedjax_dg.data.builders.domainbed_folder import Pacs
from fedjax_dg.data.builders.domainbed_folder import Vlcs
from fedjax_dg.data.builders.rotated_fashion_mnist import RotatedFashionMnist

__all__ = [
    "DomainBedFolder",
    "OfficeHome",
    "Pacs",
    "RotatedFashionMnist",
    "Vlcs",
]
