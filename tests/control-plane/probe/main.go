// Command probe is the one program of the test image `capstan.dev/probe` that a real
// node's end-to-end tests run in Pods: small, static, standard library only, and each
// subcommand proves one thing a container can do.
//
//	probe sleep              block until killed (the default)
//	probe serve ADDR         answer every HTTP request with "probe <hostname>"
//	probe get URL            print the body of an HTTP GET
//	probe resolve NAME       print NAME's addresses, through the Pod's resolv.conf
//	probe whoami             ask the API server, with the Pod's ServiceAccount token and
//	                         through https://kubernetes.default.svc, who it is
//	probe write FILE TEXT    write TEXT into FILE
//	probe cat FILE           print FILE
package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"
)

const serviceAccount = "/var/run/secrets/kubernetes.io/serviceaccount"

func main() {
	args := os.Args[1:]
	if len(args) == 0 {
		args = []string{"sleep"}
	}
	if err := run(args[0], args[1:]); err != nil {
		fmt.Fprintf(os.Stderr, "probe %s: %v\n", args[0], err)
		os.Exit(1)
	}
}

func run(command string, args []string) error {
	arg := func(i int) string {
		if i < len(args) {
			return args[i]
		}
		return ""
	}
	switch command {
	case "sleep":
		stop := make(chan os.Signal, 1)
		signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
		<-stop
		return nil
	case "serve":
		host, _ := os.Hostname()
		fmt.Fprintf(os.Stderr, "probe: serving on %s\n", arg(0))
		return http.ListenAndServe(arg(0), http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			fmt.Fprintf(w, "probe %s\n", host)
		}))
	case "get":
		client := http.Client{Timeout: 10 * time.Second}
		resp, err := client.Get(arg(0))
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		_, err = io.Copy(os.Stdout, resp.Body)
		return err
	case "resolve":
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		addrs, err := net.DefaultResolver.LookupHost(ctx, arg(0))
		if err != nil {
			return err
		}
		for _, a := range addrs {
			fmt.Println(a)
		}
		return nil
	case "whoami":
		return whoami()
	case "write":
		return os.WriteFile(arg(0), []byte(arg(1)), 0o644)
	case "cat":
		data, err := os.ReadFile(arg(0))
		if err != nil {
			return err
		}
		_, err = os.Stdout.Write(data)
		return err
	default:
		return fmt.Errorf("unknown command (sleep, serve, get, resolve, whoami, write, cat)")
	}
}

// whoami posts a SelfSubjectReview, which any authenticated identity may, and prints the
// API server's answer: the user name it authenticated the token as.
func whoami() error {
	token, err := os.ReadFile(serviceAccount + "/token")
	if err != nil {
		return err
	}
	caPEM, err := os.ReadFile(serviceAccount + "/ca.crt")
	if err != nil {
		return err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(caPEM) {
		return fmt.Errorf("no certificate in %s/ca.crt", serviceAccount)
	}
	client := http.Client{
		Timeout:   10 * time.Second,
		Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}},
	}
	body := []byte(`{"apiVersion":"authentication.k8s.io/v1","kind":"SelfSubjectReview"}`)
	req, err := http.NewRequest("POST", "https://kubernetes.default.svc/apis/authentication.k8s.io/v1/selfsubjectreviews", bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Authorization", "Bearer "+string(bytes.TrimSpace(token)))
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	answer, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusCreated {
		return fmt.Errorf("%s: %s", resp.Status, answer)
	}
	_, err = os.Stdout.Write(answer)
	return err
}
