module capstan/control-plane/pki

go 1.26.0
