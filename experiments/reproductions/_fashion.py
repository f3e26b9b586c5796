"""The workload the image reproductions run on real data: data=fashion_mnist (60,000 training and 10,000 test
images of 28x28, Debian's dataset-fashion-mnist) with the CNN of its single-model baseline (experiment=
fashion_mnist_cnn: model=cnn, its features pooled to 7x7 and a hidden layer of 128; 0.21 M parameters). Until
2026-12-06 these reproductions ran on scikit-learn's digits (lian2017) and the 5,000-image MNIST subset (lin2021's
harder task): docs/reproductions.md keeps the verdicts on that data beside these."""

FASHION = ["data=fashion_mnist", "model=cnn", "model.pool=7", "model.hidden=[128]"]
WORDS = "Fashion-MNIST (the CNN)"  # the workload in the tables' words
